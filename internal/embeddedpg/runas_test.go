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

func TestUnreachableDataDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only meaningful as root")
	}
	locked := filepath.Join(filepath.Dir(tempDataDir(t)), "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(locked, "x", ".tally")
	_, err := Start(context.Background(), Config{DataDir: dataDir, Logger: quietLogger()})
	if err == nil {
		t.Fatal("Start succeeded under a 0700 root directory")
	}
	msg := err.Error()
	for _, want := range []string{dataDir, "not reachable", locked + " is mode 0700", "TALLY_DATA_DIR"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not mention %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("error is not one line: %q", msg)
	}
	if _, err := os.Stat(filepath.Join(locked, "x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Start created directories before failing: %v", err)
	}
}

// TestFallbackForUnreachableDataDir: a data directory under a directory the
// server user cannot traverse is unreachable, and so is one under a
// directory another user owns, while one it can reach is not; and
// the fallback is stable per absolute path, distinct between paths, and
// reachable.
func TestFallbackForUnreachableDataDir(t *testing.T) {
	base := filepath.Dir(tempDataDir(t))
	locked := filepath.Join(base, "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	inLocked, inOpen := filepath.Join(locked, "repo", ".tally"), filepath.Join(open, ".tally")
	if Unreachable(inOpen, "") {
		t.Errorf("%s reported unreachable", inOpen)
	}
	if got, want := Unreachable(inLocked, ""), os.Geteuid() == 0; got != want {
		t.Errorf("Unreachable(%s) = %v, want %v (root: %v)", inLocked, got, want, os.Geteuid() == 0)
	}
	foreign := filepath.Join(base, "foreign")
	if err := os.Mkdir(foreign, 0o755); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := os.Chown(foreign, otherUID, otherUID); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := Unreachable(filepath.Join(foreign, ".tally"), ""), os.Geteuid() == 0; got != want {
		t.Errorf("Unreachable(%s), under another user's directory, = %v, want %v", foreign, got, want)
	}
	if first, again := Fallback(inLocked), Fallback(filepath.Join(locked, "repo", "..", "repo", ".tally")); first != again || first == Fallback(inOpen) {
		t.Errorf("fallbacks not stable and distinct: %s, %s", Fallback(inLocked), Fallback(inOpen))
	}
	if !strings.HasPrefix(Fallback(inLocked), "/var/lib/tally-dev/") {
		t.Errorf("fallback %s is not under /var/lib/tally-dev", Fallback(inLocked))
	}
	if Unreachable(Fallback(inLocked), "") {
		t.Errorf("the fallback %s is itself unreachable", Fallback(inLocked))
	}
}
