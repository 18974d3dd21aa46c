package embeddedpg

import (
	"fmt"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
)

// runAs is the unprivileged identity used when the process is root.
type runAs struct {
	name   string
	home   string // the HOME of the children
	uid    uint32
	gid    uint32
	groups []uint32
}

// chown gives the open file f to r; f's name is never looked up again, so a
// link planted in its place is not followed. A nil r does nothing.
func (r *runAs) chown(f *os.File) error {
	if r == nil {
		return nil
	}
	return f.Chown(int(r.uid), int(r.gid))
}

func lookupRunAs(name string) (*runAs, error) {
	if name == "" {
		name = "nobody"
		if _, err := user.Lookup("postgres"); err == nil {
			name = "postgres"
		}
	}
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: cannot run PostgreSQL as user %q: %w", name, err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("embeddedpg: user %q has a non-numeric uid or gid", name)
	}
	if uid == 0 {
		return nil, fmt.Errorf("embeddedpg: refusing to run PostgreSQL as user %q: it is root", name)
	}
	r := &runAs{name: name, home: u.HomeDir, uid: uint32(uid), gid: uint32(gid), groups: []uint32{}}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if g, err := strconv.ParseUint(id, 10, 32); err == nil {
				r.groups = append(r.groups, uint32(g))
			}
		}
	}
	return r, nil
}

func (r *runAs) inGroup(gid uint32) bool {
	if gid == r.gid {
		return true
	}
	for _, g := range r.groups {
		if g == gid {
			return true
		}
	}
	return false
}

// prepareDataDir creates dataDir (mode 0755) when missing, after checking
// that nobody but root and tally's own user could change what it names
// (checkTrusted), and checks that again once it exists. When the process
// is root it first picks the unprivileged user that will run PostgreSQL,
// returned as the runAs (nil otherwise), and checks that the user can reach
// dataDir, before and after creating it.
func prepareDataDir(cfg Config) (*runAs, error) {
	dataDir := cfg.DataDir
	if err := checkTrusted(dataDir); err != nil {
		return nil, err
	}
	var as *runAs
	if os.Geteuid() == 0 {
		var err error
		if as, err = lookupRunAs(cfg.User); err != nil {
			return nil, err
		}
		if err := grantSearch(dataDir, cfg.Logger); err != nil {
			return nil, err
		}
		if err := checkReachable(dataDir, as); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("embeddedpg: create data directory: %w", err)
	}
	// Again, now that it exists: another user may have made it first, and
	// the umask may have restricted new directories.
	if err := checkTrusted(dataDir); err != nil {
		return nil, err
	}
	if as != nil {
		if err := checkReachable(dataDir, as); err != nil {
			return nil, err
		}
	}
	return as, nil
}

// checkReachable verifies that r can traverse every existing ancestor of dir
// (and dir itself, if it exists), following symlinks.
func checkReachable(dir string, r *runAs) error {
	existing := dir
	for {
		if _, err := os.Stat(existing); err == nil {
			break
		}
		parent := filepath.Dir(existing)
		if parent == existing {
			return nil
		}
		existing = parent
	}
	if resolved, err := filepath.EvalSymlinks(existing); err == nil {
		existing = resolved
	}
	var chain []string
	for p := existing; ; p = filepath.Dir(p) {
		chain = append(chain, p)
		if filepath.Dir(p) == p {
			break
		}
	}
	for i := len(chain) - 1; i >= 0; i-- {
		if err := checkSearchable(dir, chain[i], r); err != nil {
			return err
		}
	}
	return nil
}

// checkSearchable verifies that r may search the directory p, an ancestor
// of the data directory dir, by its mode bits.
func checkSearchable(dir, p string, r *runAs) error {
	fi, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("embeddedpg: data directory %s: %w", dir, err)
	}
	uid, gid, ok := fileOwner(fi)
	if !ok {
		return nil
	}
	perm := fi.Mode().Perm()
	var bit os.FileMode
	switch {
	case uid == r.uid:
		bit = 0o100
	case r.inGroup(gid):
		bit = 0o010
	default:
		bit = 0o001
	}
	if perm&bit == 0 {
		return fmt.Errorf("data directory %s is not reachable by the unprivileged user %q that runs PostgreSQL when tally runs as root (%s is mode %04o); %s",
			dir, r.name, p, perm, unreachableAdvice)
	}
	return nil
}

// grantSearch adds search (x, not read) permission for group and others to
// an existing data directory that root owns, such as the 0700 directory
// `mktemp -d` makes, so that the unprivileged user can reach pgdata inside
// it. The directory is tally's own; its ancestors are never changed.
func grantSearch(dataDir string, logger *slog.Logger) error {
	d, err := os.Open(dataDir) // checkTrusted has checked any link on the way
	if err != nil {
		return nil // missing: created 0755 below
	}
	defer d.Close()
	fi, err := d.Stat()
	if err != nil || !fi.IsDir() {
		return nil // not a directory: reported below
	}
	uid, _, ok := fileOwner(fi)
	if !ok || uid != uint32(os.Geteuid()) || fi.Mode().Perm()&0o011 == 0o011 {
		return nil
	}
	mode := fi.Mode().Perm() | 0o011
	if err := d.Chmod(mode); err != nil {
		return fmt.Errorf("embeddedpg: granting search permission on data directory %s: %w", dataDir, err)
	}
	logger.Info("granted search permission on the data directory so that the unprivileged server user can reach pgdata",
		"dir", dataDir, "mode", fmt.Sprintf("%04o", mode))
	return nil
}

// checkOwner verifies that the existing cluster pgdata belongs to the user
// that will run PostgreSQL.
func checkOwner(pgdata string, as *runAs) error {
	fi, err := os.Stat(pgdata)
	if err != nil {
		return fmt.Errorf("embeddedpg: %w", err)
	}
	if uid, _, ok := fileOwner(fi); ok && uid != as.uid {
		return fmt.Errorf("embeddedpg: cluster %s is owned by uid %d but PostgreSQL runs as user %q (uid %d); chown it or set Config.User", pgdata, uid, as.name, as.uid)
	}
	return nil
}
