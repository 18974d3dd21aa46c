//go:build unix

package embeddedpg

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// otherUID is a user that is neither root nor tally: nobody's customary uid,
// which needs no account to own files.
const otherUID = 65534

// TestRefusesDataDirOthersControl: run as root, Start refuses a data
// directory another user owns, one that group or others may write, and one
// it would create under a parent another user owns — before it opens, chowns
// or creates anything there — and a postgres.log that is a link, even in a
// directory of root's. The planted link to a root-owned file is not
// followed: the file keeps its owner, mode and content.
func TestRefusesDataDirOthersControl(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root can give a directory to another user and be turned against the host")
	}
	t.Parallel()
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, base, dataDir string)
		want  string // in the error, after the offending path
	}{
		{"owned by another user", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, dataDir, otherUID, 0o755)
		}, "is owned by uid 65534"},
		{"writable by others", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, dataDir, 0, 0o777)
		}, "is writable by group or others"},
		{"writable by group", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, dataDir, 0, 0o775)
			if err := os.Chown(dataDir, 0, otherUID); err != nil {
				t.Fatal(err)
			}
		}, "is writable by group or others"},
		{"under a parent of another user", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, filepath.Dir(dataDir), otherUID, 0o755)
		}, "is owned by uid 65534"},
		{"a link in a directory of root's", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, dataDir, 0, 0o755)
		}, "is a symbolic link"},
		{"a hard link in a directory of root's", func(t *testing.T, base, dataDir string) {
			mkdirOwned(t, dataDir, 0, 0o755)
			if err := os.Link(filepath.Join(base, "victim"), filepath.Join(dataDir, logName)); err != nil {
				t.Fatal(err)
			}
		}, "has 2 hard links"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			base := filepath.Dir(tempDataDir(t))
			dataDir := filepath.Join(base, "home", ".tally")
			victim := filepath.Join(base, "victim")
			const content = "root's own file\n"
			if err := os.WriteFile(victim, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
			tc.setup(t, base, dataDir)
			if _, err := os.Lstat(filepath.Join(dataDir, logName)); errors.Is(err, os.ErrNotExist) && isDir(dataDir) {
				// The planted link, as the other user would make it.
				if err := os.Symlink(victim, filepath.Join(dataDir, logName)); err != nil {
					t.Fatal(err)
				}
				if err := os.Lchown(filepath.Join(dataDir, logName), otherUID, otherUID); err != nil {
					t.Fatal(err)
				}
			}

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c, err := Start(ctx, Config{DataDir: dataDir, Ephemeral: true, Logger: quietLogger()})
			if err == nil {
				_ = c.Stop(context.Background())
				t.Errorf("Start used a data directory others control")
			} else if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), base) || strings.Contains(err.Error(), "\n") {
				t.Errorf("error %q does not name the path and say %q", err, tc.want)
			}
			fi, serr := os.Stat(victim)
			b, rerr := os.ReadFile(victim)
			if serr != nil || rerr != nil {
				t.Fatalf("victim: %v %v", serr, rerr)
			}
			if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || st.Gid != 0 || fi.Mode().Perm() != 0o644 || string(b) != content {
				t.Errorf("the planted link was followed: victim is now uid %d gid %d mode %04o, %d bytes", st.Uid, st.Gid, fi.Mode().Perm(), len(b))
			}
			if _, err := os.Stat(filepath.Join(dataDir, pgdataName)); err == nil {
				t.Errorf("Start created a cluster in %s", dataDir)
			}
		})
	}
}

func mkdirOwned(t *testing.T, dir string, uid int, perm os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, uid, uid); err != nil {
		t.Fatal(err)
	}
}

func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

// TestTrustsWhatOnlyTrustedUsersChange: a directory its owner's private
// group may write (as umask 002 makes them) and a sticky ancestor (as /tmp)
// are trusted; a sticky data directory itself, where others may add files,
// is not.
func TestTrustsWhatOnlyTrustedUsersChange(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only root can give a directory root's group, whose name is root's")
	}
	t.Parallel()
	base := filepath.Dir(tempDataDir(t))
	private := filepath.Join(base, "private", ".tally")
	mkdirOwned(t, private, 0, 0o775)
	if err := os.Chmod(filepath.Dir(private), 0o775); err != nil {
		t.Fatal(err)
	}
	if err := checkTrusted(private); err != nil {
		t.Errorf("group-writable by root's own group: %v", err)
	}
	sticky := filepath.Join(base, "sticky")
	mkdirOwned(t, sticky, 0, 0o777|os.ModeSticky)
	if err := checkTrusted(filepath.Join(sticky, ".tally")); err != nil {
		t.Errorf("under a sticky directory: %v", err)
	}
	if err := checkTrusted(sticky); err == nil || !strings.Contains(err.Error(), "writable by group or others") {
		t.Errorf("a sticky data directory: %v", err)
	}
}
