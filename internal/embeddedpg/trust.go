package embeddedpg

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
)

// maxLinks bounds the symbolic links checkTrusted follows on one path.
const maxLinks = 16

// untrustedAdvice ends the error of a data directory others could change.
const untrustedAdvice = "set TALLY_DATA_DIR to a directory only root or tally's own user can change, e.g. /var/lib/tally"

// checkTrusted verifies that nobody but root and the user tally runs as
// can change what dataDir names, so that a file Start opens there is the
// one it means: dataDir, when it exists, and each of its ancestors must be
// owned by root or by tally's user and not be writable by group or others.
// Group-writable is fine when the group is the owner's private group
// (privateGroup). An ancestor may be a sticky directory such as /tmp, where
// others may add entries but not rename or remove ours. A symbolic link on the way must be
// owned by root or tally's user too, and its target is checked the same
// way. The user that runs PostgreSQL when tally is root is not trusted
// here: it owns only what Start gives it inside dataDir (pgdata and
// postgres.log). Where files have no Unix owner (Windows) nothing is
// checked.
func checkTrusted(dataDir string) error {
	return checkChain(dataDir, dataDir, 0)
}

// checkChain checks path, which stands for dataDir once the links symbolic
// links on the way have been followed, from the root down to its first
// missing component.
func checkChain(dataDir, path string, links int) error {
	path = filepath.Clean(path)
	parts := strings.Split(strings.TrimPrefix(path, string(filepath.Separator)), string(filepath.Separator))
	p := string(filepath.Separator)
	if vol := filepath.VolumeName(path); vol != "" {
		return nil // Windows: no owners to check
	}
	for i := -1; i < len(parts); i++ {
		if i >= 0 {
			if parts[i] == "" {
				continue
			}
			p = filepath.Join(p, parts[i])
		}
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil // Start creates the rest under the last, checked, directory
		}
		if err != nil {
			return fmt.Errorf("embeddedpg: data directory %s: %w", dataDir, err)
		}
		uid, gid, ok := fileOwner(fi)
		if !ok {
			return nil
		}
		if !trustedOwner(uid) {
			return fmt.Errorf("embeddedpg: %s is owned by uid %d%s, not by root or the user tally runs as; that user could change what it holds; %s",
				where(dataDir, p), uid, userName(uid), untrustedAdvice)
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			if links++; links > maxLinks {
				return fmt.Errorf("embeddedpg: data directory %s: too many symbolic links", dataDir)
			}
			target, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("embeddedpg: data directory %s: %w", dataDir, err)
			}
			if !filepath.IsAbs(target) {
				target = filepath.Join(filepath.Dir(p), target)
			}
			return checkChain(dataDir, filepath.Join(append([]string{target}, parts[i+1:]...)...), links)
		}
		if !fi.IsDir() {
			return fmt.Errorf("embeddedpg: %s is not a directory", where(dataDir, p))
		}
		last := i == len(parts)-1
		writable := fi.Mode().Perm() & 0o022
		if writable&0o020 != 0 && privateGroup(uid, gid) {
			writable &^= 0o020
		}
		if writable != 0 && (last || fi.Mode()&fs.ModeSticky == 0) {
			return fmt.Errorf("embeddedpg: %s is writable by group or others (mode %04o), who could change what it holds; %s",
				where(dataDir, p), fi.Mode().Perm(), untrustedAdvice)
		}
	}
	return nil
}

// where names p, dataDir or one of its ancestors, in an error.
func where(dataDir, p string) string {
	if p == dataDir {
		return "data directory " + dataDir
	}
	return "data directory " + dataDir + ": " + p
}

// trustedOwner reports whether uid may own the data directory and its
// ancestors: root, or the user tally runs as.
func trustedOwner(uid uint32) bool {
	return uid == 0 || int64(uid) == int64(os.Geteuid())
}

// privateGroup reports whether gid is uid's own group: its primary group,
// named after it, as systems with a umask of 002 give every user, so that
// their directories are group-writable by nobody else.
func privateGroup(uid, gid uint32) bool {
	u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10))
	if err != nil || u.Gid != strconv.FormatUint(uint64(gid), 10) {
		return false
	}
	g, err := user.LookupGroupId(u.Gid)
	return err == nil && g.Name == u.Username
}

// userName is " (name)" for uid, or nothing when uid has no name.
func userName(uid uint32) string {
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		return " (" + u.Username + ")"
	}
	return ""
}
