package embeddedpg

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// ErrNoBinaries is wrapped in the error FindBinaries returns when no
// PostgreSQL server binaries (initdb and postgres) can be found.
var ErrNoBinaries = errors.New("no PostgreSQL server binaries found")

// FindBinaries returns the directory holding the initdb and postgres
// binaries. It looks on PATH first (resolving symlinks, so a PATH entry of
// /usr/local/bin/initdb linking to /usr/lib/postgresql/15/bin/initdb yields
// /usr/lib/postgresql/15/bin), then picks the highest version among the
// platform's usual install locations: /usr/lib/postgresql/*/bin on Linux;
// on macOS Homebrew's (/opt/homebrew/opt/postgresql@N/bin,
// /usr/local/opt/postgresql@N/bin, /opt/homebrew/bin, /usr/local/bin) and
// Postgres.app's (/Applications/Postgres.app/Contents/Versions/*/bin). If
// none has them, it returns a one-line error wrapping ErrNoBinaries that
// says what to install or set.
func FindBinaries() (string, error) {
	if dir, ok := binariesOnPATH(); ok {
		return dir, nil
	}
	if dir, ok := newestInstalled(searchGlobs); ok {
		return dir, nil
	}
	return "", fmt.Errorf("%w (looked for initdb and postgres on PATH and in %s): install PostgreSQL (%s) or set TALLY_DATABASE_URL",
		ErrNoBinaries, strings.Join(searchGlobs, ", "), installAdvice)
}

// binariesOnPATH returns the directory, symlinks resolved, of the first
// initdb or postgres on PATH that has both binaries beside it.
func binariesOnPATH() (string, bool) {
	for _, name := range []string{"initdb", "postgres"} {
		p, err := exec.LookPath(name)
		if err != nil {
			continue
		}
		if r, err := filepath.EvalSymlinks(p); err == nil {
			p = r
		}
		if abs, err := filepath.Abs(p); err == nil {
			p = abs
		}
		if dir := filepath.Dir(p); hasServerBinaries(dir) {
			return dir, true
		}
	}
	return "", false
}

// newestInstalled returns, of the directories matching globs that hold both
// binaries, the one of the highest version; among equal versions, the first
// match of the first glob.
func newestInstalled(globs []string) (string, bool) {
	var matches []string
	for _, g := range globs {
		m, _ := filepath.Glob(g)
		matches = append(matches, m...)
	}
	versions := make(map[string][]int, len(matches))
	for _, dir := range matches {
		versions[dir] = installedVersion(dir)
	}
	sort.SliceStable(matches, func(i, j int) bool {
		return versionLess(versions[matches[j]], versions[matches[i]])
	})
	for _, dir := range matches {
		if hasServerBinaries(dir) {
			return dir, true
		}
	}
	return "", false
}

// macSearchGlobs are the places macOS keeps PostgreSQL's server binaries,
// under root: Homebrew's versioned formulae (Apple silicon, then Intel), the
// Postgres.app versions (latest among them), then Homebrew's linked
// binaries. It is a function of root so that tests on any platform can lay
// out a fake machine.
func macSearchGlobs(root string) []string {
	return []string{
		filepath.Join(root, "opt/homebrew/opt/postgresql@*/bin"),
		filepath.Join(root, "usr/local/opt/postgresql@*/bin"),
		filepath.Join(root, "Applications/Postgres.app/Contents/Versions/*/bin"),
		filepath.Join(root, "opt/homebrew/bin"),
		filepath.Join(root, "usr/local/bin"),
	}
}

func hasServerBinaries(dir string) bool {
	return isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres"))
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// installedVersion is the version of the binaries in binDir: that of the
// directory its initdb really lives in (Homebrew links /opt/homebrew/bin's
// into its Cellar, Postgres.app's Versions/latest is a link), else that of
// binDir itself.
func installedVersion(binDir string) []int {
	if real, err := filepath.EvalSymlinks(filepath.Join(binDir, "initdb")); err == nil {
		return dirVersion(filepath.Dir(real))
	}
	return dirVersion(binDir)
}

// dirVersion parses the version out of a directory like
// /usr/lib/postgresql/15/bin or /opt/homebrew/opt/postgresql@16/bin (the
// parent's name, after any "@"), e.g. [15] or [9 6]; a name that is not a
// version, like latest, parses as [-1] and ranks below every version.
func dirVersion(binDir string) []int {
	name := filepath.Base(filepath.Dir(binDir))
	if i := strings.LastIndexByte(name, '@'); i >= 0 {
		name = name[i+1:]
	}
	var v []int
	for _, part := range strings.Split(name, ".") {
		n, err := strconv.Atoi(part)
		if err != nil {
			n = -1
		}
		v = append(v, n)
	}
	return v
}

func versionLess(a, b []int) bool {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return len(a) < len(b)
}
