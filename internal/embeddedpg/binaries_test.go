//go:build unix

package embeddedpg

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFindBinariesWithoutPATH(t *testing.T) {
	t.Setenv("PATH", "")
	dir, err := FindBinaries()
	if err != nil {
		t.Skipf("no PostgreSQL in %s: %v", strings.Join(searchGlobs, ", "), err)
	}
	matched := false
	for _, g := range searchGlobs {
		if ok, _ := filepath.Match(g, dir); ok {
			matched = true
		}
	}
	if !matched {
		t.Fatalf("FindBinaries() = %q, want a match of one of %s", dir, searchGlobs)
	}
	for _, b := range []string{"initdb", "postgres"} {
		if !isExecutable(filepath.Join(dir, b)) {
			t.Errorf("%s missing in %s", b, dir)
		}
	}
}

func TestFindBinariesResolvesPATHSymlinks(t *testing.T) {
	t.Setenv("PATH", "")
	real, err := FindBinaries()
	if err != nil {
		t.Skip(err)
	}
	linkDir := t.TempDir()
	for _, b := range []string{"initdb", "postgres"} {
		if err := os.Symlink(filepath.Join(real, b), filepath.Join(linkDir, b)); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", linkDir)
	emptySearch(t)
	got, err := FindBinaries()
	if err != nil || got != real {
		t.Fatalf("FindBinaries() = %q, %v; want %q", got, err, real)
	}
}

func TestFindBinariesNone(t *testing.T) {
	t.Setenv("PATH", "")
	emptySearch(t)

	_, err := FindBinaries()
	if !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("err = %v, want ErrNoBinaries", err)
	}
	msg := err.Error()
	if !strings.Contains(msg, "TALLY_DATABASE_URL") || !strings.Contains(msg, installAdvice) || strings.Contains(msg, "\n") {
		t.Fatalf("unhelpful message: %q", msg)
	}
	if _, err := Start(context.Background(), Config{DataDir: t.TempDir()}); !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("Start without binaries: %v", err)
	}
}

// emptySearch points FindBinaries' search after PATH at an empty directory
// for the rest of t.
func emptySearch(t *testing.T) {
	saved := searchGlobs
	searchGlobs = []string{filepath.Join(t.TempDir(), "*", "bin")}
	t.Cleanup(func() { searchGlobs = saved })
}

// TestFindBinariesMacOSLayouts lays out, under a fake root, the places
// Homebrew and Postgres.app install PostgreSQL, and checks that the newest
// major version wins wherever it is, that Postgres.app's latest link counts
// as the version it points at, that a directory missing a binary is passed
// over, and that Homebrew's linked binaries are the last resort.
func TestFindBinariesMacOSLayouts(t *testing.T) {
	root := t.TempDir()
	install := func(dir string, binaries ...string) string {
		t.Helper()
		dir = filepath.Join(root, dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, b := range binaries {
			if err := os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/sh\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	globs := macSearchGlobs(root)
	find := func() string {
		t.Helper()
		dir, ok := newestInstalled(globs)
		if !ok {
			t.Fatal("nothing found")
		}
		return dir
	}

	linked := install("opt/homebrew/bin", "initdb", "postgres")
	if got := find(); got != linked {
		t.Fatalf("only Homebrew's linked binaries: got %s", got)
	}
	armBrew15 := install("opt/homebrew/opt/postgresql@15/bin", "initdb", "postgres")
	intelBrew16 := install("usr/local/opt/postgresql@16/bin", "initdb", "postgres")
	install("opt/homebrew/opt/postgresql@18/bin", "initdb") // no postgres: skipped
	if got := find(); got != intelBrew16 {
		t.Fatalf("Homebrew 15 (Apple silicon) and 16 (Intel): got %s, want %s", got, intelBrew16)
	}
	app17 := install("Applications/Postgres.app/Contents/Versions/17/bin", "initdb", "postgres")
	if err := os.Symlink("17", filepath.Join(root, "Applications/Postgres.app/Contents/Versions/latest")); err != nil {
		t.Fatal(err)
	}
	if got := find(); got != app17 {
		t.Fatalf("with Postgres.app 17: got %s, want %s", got, app17)
	}
	if v := installedVersion(filepath.Join(root, "Applications/Postgres.app/Contents/Versions/latest/bin")); versionLess(v, []int{17}) || versionLess([]int{17}, v) {
		t.Errorf("Postgres.app's latest reads as version %v, want [17]", v)
	}
	if err := os.RemoveAll(app17); err != nil {
		t.Fatal(err)
	}
	if got := find(); got != intelBrew16 {
		t.Fatalf("Postgres.app gone: got %s, want %s", got, intelBrew16)
	}
	if err := os.RemoveAll(intelBrew16); err != nil {
		t.Fatal(err)
	}
	if got := find(); got != armBrew15 {
		t.Fatalf("Homebrew 15 alone among versions: got %s, want %s", got, armBrew15)
	}
}

func TestDirVersion(t *testing.T) {
	for dir, want := range map[string][]int{
		"/usr/lib/postgresql/15/bin":                              {15},
		"/usr/lib/postgresql/9.6/bin":                             {9, 6},
		"/opt/homebrew/opt/postgresql@17/bin":                     {17},
		"/opt/homebrew/Cellar/postgresql@16/16.4/bin":             {16, 4},
		"/Applications/Postgres.app/Contents/Versions/16/bin":     {16},
		"/Applications/Postgres.app/Contents/Versions/latest/bin": {-1},
		"/opt/homebrew/bin":                                       {-1},
	} {
		got := dirVersion(dir)
		if versionLess(got, want) || versionLess(want, got) {
			t.Errorf("dirVersion(%s) = %v, want %v", dir, got, want)
		}
	}
}
