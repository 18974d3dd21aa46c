// Package embeddedpg owns the lifecycle of a private PostgreSQL cluster built
// from the PostgreSQL server binaries installed on the machine: it finds the
// binaries, runs initdb once into a data directory it owns, starts the server
// as a child process listening only on 127.0.0.1, and stops it again.
//
// The package never touches a cluster it did not create: it refuses to reuse
// or delete a non-empty directory that is not a cluster, and it refuses to
// start when another server is running on the same data directory. It never
// runs postgres or initdb as root (when the process is root they run as an
// unprivileged user), and it never logs the superuser password or a URL that
// contains it.
package embeddedpg

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNoBinaries is wrapped in the error FindBinaries returns when no
// PostgreSQL server binaries (initdb and postgres) can be found.
var ErrNoBinaries = errors.New("no PostgreSQL server binaries found")

// searchGlob is where FindBinaries looks when PATH has no server binaries.
// It is a variable only so that tests can point it at an empty directory.
var searchGlob = "/usr/lib/postgresql/*/bin"

const (
	superuser         = "tally"
	listenAddress     = "127.0.0.1"
	pgdataName        = "pgdata"
	initdbTmpName     = "pgdata.initdb"
	logName           = "postgres.log"
	passwordName      = "password"
	logTailLines      = 20
	defaultTimeout    = 60 * time.Second
	killGrace         = 5 * time.Second
	portAttempts      = 3
	pollInterval      = 100 * time.Millisecond
	connectTimeout    = 2 * time.Second
	defaultMaxConns   = "200"
	unreachableAdvice = "set TALLY_DATA_DIR to a directory it can reach, e.g. /var/lib/tally or /tmp/tally"
)

// reservedSettings are server settings Start controls itself; Config.Settings
// may not override them.
var reservedSettings = []string{"port", "listen_addresses", "unix_socket_directories"}

// Config describes the cluster Start creates or reuses.
type Config struct {
	// DataDir is required. Start uses DataDir/pgdata for the cluster,
	// DataDir/postgres.log for the server log and DataDir/password (mode 0600)
	// for the superuser password generated at initdb. DataDir is created with
	// mode 0755 when missing.
	DataDir string

	// Port is the TCP port on 127.0.0.1 the server listens on. The default, 0,
	// picks a free port at every start.
	Port int

	// Ephemeral tunes the cluster for throwaway test use: fsync=off,
	// synchronous_commit=off, full_page_writes=off and initdb --no-sync. The
	// default is false, which keeps the data crash-safe.
	Ephemeral bool

	// User is the OS user that runs initdb and postgres when the process runs
	// as root. The default is "postgres" if that user exists, else "nobody".
	// User is ignored when the process is not root.
	User string

	// StartTimeout bounds how long Start waits for the server to accept a
	// connection after launching it. The default is 60s.
	StartTimeout time.Duration

	// Logger receives one line when the server starts and one when it stops.
	// It is never given the password. The default is slog.Default().
	Logger *slog.Logger

	// Settings holds extra server settings, each passed as -c name=value.
	// They override the package's defaults (max_connections=200 and, when
	// Ephemeral, the durability settings). The default is none. port,
	// listen_addresses and unix_socket_directories are controlled by Start and
	// may not be set here.
	Settings map[string]string
}

// Cluster is a running private PostgreSQL server started by Start.
type Cluster struct {
	dataDir  string
	port     int
	password string
	logger   *slog.Logger

	proc    *os.Process
	done    chan struct{}
	waitErr error // written before done is closed

	ready    atomic.Bool
	stopping atomic.Bool
	stopLog  sync.Once
}

// FindBinaries returns the directory holding the initdb and postgres
// binaries. It looks on PATH first (resolving symlinks, so a PATH entry of
// /usr/local/bin/initdb linking to /usr/lib/postgresql/15/bin/initdb yields
// /usr/lib/postgresql/15/bin), then picks the highest version under
// /usr/lib/postgresql/*/bin. When nothing is found it returns a one-line error
// wrapping ErrNoBinaries that says what to install or set.
func FindBinaries() (string, error) {
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
			return dir, nil
		}
	}
	matches, _ := filepath.Glob(searchGlob)
	sort.SliceStable(matches, func(i, j int) bool {
		return versionLess(dirVersion(matches[j]), dirVersion(matches[i]))
	})
	for _, dir := range matches {
		if hasServerBinaries(dir) {
			return dir, nil
		}
	}
	return "", fmt.Errorf("%w (looked for initdb and postgres on PATH and in %s): install PostgreSQL (Debian: apt-get install postgresql) or set TALLY_DATABASE_URL",
		ErrNoBinaries, searchGlob)
}

func hasServerBinaries(dir string) bool {
	return isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres"))
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// dirVersion parses the version out of a directory like
// /usr/lib/postgresql/15/bin (the parent's name), e.g. [15] or [9 6].
func dirVersion(binDir string) []int {
	var v []int
	for _, part := range strings.Split(filepath.Base(filepath.Dir(binDir)), ".") {
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

// runAs is the unprivileged identity used when the process is root.
type runAs struct {
	name   string
	uid    uint32
	gid    uint32
	groups []uint32
}

func (r *runAs) credential() *syscall.Credential {
	if r == nil {
		return nil
	}
	// An empty Groups clears root's supplementary groups in the child.
	return &syscall.Credential{Uid: r.uid, Gid: r.gid, Groups: r.groups}
}

func (r *runAs) chown(path string) error {
	if r == nil {
		return nil
	}
	return os.Chown(path, int(r.uid), int(r.gid))
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
	r := &runAs{name: name, uid: uint32(uid), gid: uint32(gid), groups: []uint32{}}
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
		p := chain[i]
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("embeddedpg: data directory %s: %w", dir, err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			continue
		}
		perm := fi.Mode().Perm()
		var bit os.FileMode
		switch {
		case st.Uid == r.uid:
			bit = 0o100
		case r.inGroup(st.Gid):
			bit = 0o010
		default:
			bit = 0o001
		}
		if perm&bit == 0 {
			return fmt.Errorf("data directory %s is not reachable by the unprivileged user %q that runs PostgreSQL when tally runs as root (%s is mode %04o); %s",
				dir, r.name, p, perm, unreachableAdvice)
		}
	}
	return nil
}

// grantSearch adds search (x, not read) permission for group and others to
// an existing data directory that root owns, such as the 0700 directory
// `mktemp -d` makes, so that the unprivileged user can reach pgdata inside
// it. The directory is tally's own; its ancestors are never changed.
func grantSearch(dataDir string, logger *slog.Logger) error {
	fi, err := os.Stat(dataDir)
	if err != nil || !fi.IsDir() {
		return nil // missing: created 0755 below; not a directory: reported below
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || st.Uid != uint32(os.Geteuid()) || fi.Mode().Perm()&0o011 == 0o011 {
		return nil
	}
	mode := fi.Mode().Perm() | 0o011
	if err := os.Chmod(dataDir, mode); err != nil {
		return fmt.Errorf("embeddedpg: granting search permission on data directory %s: %w", dataDir, err)
	}
	logger.Info("granted search permission on the data directory so that the unprivileged server user can reach pgdata",
		"dir", dataDir, "mode", fmt.Sprintf("%04o", mode))
	return nil
}

// Start finds the binaries, runs initdb into DataDir/pgdata if there is no
// PG_VERSION there (superuser "tally", scram-sha-256 authentication, the
// password from DataDir/password, UTF8, locale C), otherwise reuses the
// existing cluster, then starts postgres as a child process listening only on
// 127.0.0.1 with Unix sockets disabled. It returns once the server accepts a
// connection, waiting at most StartTimeout and no longer than ctx allows. If
// the server exits during startup the error includes the last lines of
// DataDir/postgres.log.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.DataDir == "" {
		return nil, errors.New("embeddedpg: Config.DataDir is required")
	}
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: data directory: %w", err)
	}
	if cfg.Port < 0 || cfg.Port > 65535 {
		return nil, fmt.Errorf("embeddedpg: invalid port %d", cfg.Port)
	}
	for name := range cfg.Settings {
		for _, r := range reservedSettings {
			if strings.EqualFold(strings.TrimSpace(name), r) {
				return nil, fmt.Errorf("embeddedpg: setting %q is controlled by embeddedpg and cannot be set in Config.Settings", name)
			}
		}
		if name == "" || strings.ContainsAny(name, "= \t\n") {
			return nil, fmt.Errorf("embeddedpg: invalid setting name %q", name)
		}
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = defaultTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}

	binDir, err := FindBinaries()
	if err != nil {
		return nil, err
	}

	var as *runAs
	if os.Geteuid() == 0 {
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
	if as != nil {
		// Again, now that it exists: the umask may have restricted new directories.
		if err := checkReachable(dataDir, as); err != nil {
			return nil, err
		}
	}

	logPath := filepath.Join(dataDir, logName)
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: open server log: %w", err)
	}
	defer logFile.Close() // the children keep their own descriptors
	if err := as.chown(logPath); err != nil {
		return nil, fmt.Errorf("embeddedpg: chown server log: %w", err)
	}

	pgdata := filepath.Join(dataDir, pgdataName)
	password, err := ensureCluster(ctx, cfg, binDir, dataDir, logFile, as)
	if err != nil {
		return nil, err
	}
	if as != nil {
		if err := checkOwner(pgdata, as); err != nil {
			return nil, err
		}
	}
	if err := checkRunningPostmaster(pgdata, cfg.Logger); err != nil {
		return nil, err
	}

	for attempt := 1; ; attempt++ {
		port := cfg.Port
		if port == 0 {
			if port, err = freePort(); err != nil {
				return nil, err
			}
		}
		c, version, err := launch(ctx, cfg, binDir, dataDir, pgdata, port, password, logFile, as)
		if err == nil {
			c.ready.Store(true)
			cfg.Logger.Info("postgres started", "dir", dataDir, "port", port, "version", version)
			go c.watch()
			return c, nil
		}
		var be *bindError
		if cfg.Port == 0 && errors.As(err, &be) && attempt < portAttempts {
			continue // lost the race for the free port; pick another
		}
		var se *shmBusyError
		if errors.As(err, &se) && attempt < shmAttempts {
			// The backends of a postmaster killed a moment ago still hold
			// its shared memory while they exit.
			select {
			case <-ctx.Done():
				return nil, err
			case <-time.After(shmRetryDelay):
			}
			continue
		}
		return nil, err
	}
}

// ensureCluster makes sure dataDir/pgdata holds an initialized cluster and
// returns the superuser password.
func ensureCluster(ctx context.Context, cfg Config, binDir, dataDir string, logFile *os.File, as *runAs) (string, error) {
	pgdata := filepath.Join(dataDir, pgdataName)
	pwPath := filepath.Join(dataDir, passwordName)

	if _, err := os.Stat(filepath.Join(pgdata, "PG_VERSION")); err == nil {
		b, err := os.ReadFile(pwPath)
		if err != nil {
			return "", fmt.Errorf("embeddedpg: cluster %s exists but its password file cannot be read: %w", pgdata, err)
		}
		pw := strings.TrimSpace(string(b))
		if pw == "" {
			return "", fmt.Errorf("embeddedpg: password file %s is empty", pwPath)
		}
		return pw, nil
	}

	// No cluster yet. Only an empty pgdata directory may be replaced.
	if entries, err := os.ReadDir(pgdata); err == nil {
		if len(entries) > 0 {
			return "", fmt.Errorf("embeddedpg: %s exists but is not a PostgreSQL cluster (no PG_VERSION); refusing to touch it", pgdata)
		}
		if err := os.Remove(pgdata); err != nil {
			return "", fmt.Errorf("embeddedpg: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}

	// initdb into a scratch directory and rename it into place on success, so
	// an interrupted initdb never leaves a half-made cluster behind in pgdata.
	tmp := filepath.Join(dataDir, initdbTmpName)
	if err := os.RemoveAll(tmp); err != nil {
		return "", fmt.Errorf("embeddedpg: remove leftover %s: %w", tmp, err)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if err := os.Chmod(tmp, 0o700); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if err := as.chown(tmp); err != nil {
		return "", fmt.Errorf("embeddedpg: chown %s: %w", tmp, err)
	}

	pw, err := newPassword()
	if err != nil {
		return "", err
	}
	if err := writeFileAtomic(pwPath, []byte(pw+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("embeddedpg: write password file: %w", err)
	}

	pwFile := pwPath
	if as != nil {
		// The unprivileged user cannot read the root-owned password file;
		// give initdb a private copy it owns and remove it right after.
		f, err := os.CreateTemp(dataDir, ".initdb-pwfile-*")
		if err != nil {
			return "", fmt.Errorf("embeddedpg: %w", err)
		}
		pwFile = f.Name()
		defer os.Remove(pwFile)
		_, werr := f.WriteString(pw + "\n")
		cerr := f.Close()
		if err := errors.Join(werr, cerr, os.Chmod(pwFile, 0o600), as.chown(pwFile)); err != nil {
			return "", fmt.Errorf("embeddedpg: prepare initdb password file: %w", err)
		}
	}

	args := []string{
		"-D", tmp,
		"-U", superuser,
		"--pwfile=" + pwFile,
		"--auth-host=scram-sha-256",
		"--auth-local=scram-sha-256",
		"-E", "UTF8",
		"--locale=C",
	}
	if cfg.Ephemeral {
		args = append(args, "--no-sync")
	}
	offset := fileSize(logFile)
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"), args...)
	cmd.Dir = dataDir
	cmd.Env = childEnv()
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, Credential: as.credential()}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if err := runLocked(cmd); err != nil {
		_ = os.RemoveAll(tmp)
		if ctx.Err() != nil {
			return "", fmt.Errorf("embeddedpg: initdb interrupted: %w", context.Cause(ctx))
		}
		return "", fmt.Errorf("embeddedpg: initdb failed (%v); last lines of %s:\n%s", err, logFile.Name(), logTail(logFile.Name(), offset))
	}
	if err := os.Rename(tmp, pgdata); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if !cfg.Ephemeral {
		syncDir(dataDir)
	}
	cfg.Logger.Debug("initialized postgres cluster", "dir", dataDir)
	return pw, nil
}

// runLocked runs cmd from a goroutine locked to its OS thread, because
// Pdeathsig fires when the thread that forked the child exits.
func runLocked(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- cmd.Run()
		// Returning while locked terminates the thread; the child is gone.
	}()
	return <-errc
}

func checkOwner(pgdata string, as *runAs) error {
	fi, err := os.Stat(pgdata)
	if err != nil {
		return fmt.Errorf("embeddedpg: %w", err)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != as.uid {
		return fmt.Errorf("embeddedpg: cluster %s is owned by uid %d but PostgreSQL runs as user %q (uid %d); chown it or set Config.User", pgdata, st.Uid, as.name, as.uid)
	}
	return nil
}

// checkRunningPostmaster fails when postmaster.pid names a live postgres
// process running on pgdata. A pid file naming a process that is alive but is
// not a postgres server on pgdata (pid reuse after a crash, common in
// containers) is removed, since postgres itself would refuse to start.
func checkRunningPostmaster(pgdata string, logger *slog.Logger) error {
	pidPath := filepath.Join(pgdata, "postmaster.pid")
	b, err := os.ReadFile(pidPath)
	if err != nil {
		return nil // no pid file, or unreadable: let postgres decide
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return nil
	}
	if pid < 0 {
		pid = -pid // a standalone backend writes its pid negated
	}
	if pid == 0 || pid == os.Getpid() {
		return nil
	}
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return nil // stale; postgres handles it
	}
	stale := false
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
		name := strings.TrimSpace(string(comm))
		stale = name != "postgres" && name != "postmaster"
	}
	if !stale {
		if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid)); err == nil {
			want := pgdata
			if r, err := filepath.EvalSymlinks(pgdata); err == nil {
				want = r
			}
			stale = cwd != want
		}
	}
	if stale {
		logger.Warn("removing stale postmaster.pid", "dir", pgdata, "pid", pid)
		if err := os.Remove(pidPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("embeddedpg: remove stale %s: %w", pidPath, err)
		}
		return nil
	}
	return fmt.Errorf("embeddedpg: another PostgreSQL server (pid %d) is already running on data directory %s; stop it first", pid, pgdata)
}

// shmBusyError reports that the server found the shared memory of an
// earlier server on the data directory still attached: the backends of a
// killed postmaster that have not exited yet.
type shmBusyError struct{ err error }

func (e *shmBusyError) Error() string { return e.err.Error() }
func (e *shmBusyError) Unwrap() error { return e.err }

// How often, and how far apart, a start is tried again while an earlier
// server's shared memory is still attached (5 s in all).
const (
	shmAttempts   = 25
	shmRetryDelay = 200 * time.Millisecond
)

// bindError reports that the server could not bind its port.
type bindError struct{ err error }

func (e *bindError) Error() string { return e.err.Error() }
func (e *bindError) Unwrap() error { return e.err }

func launch(ctx context.Context, cfg Config, binDir, dataDir, pgdata string, port int, password string, logFile *os.File, as *runAs) (*Cluster, string, error) {
	settings := map[string]string{"max_connections": defaultMaxConns}
	if cfg.Ephemeral {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	for k, v := range cfg.Settings {
		for dk := range settings {
			if strings.EqualFold(dk, strings.TrimSpace(k)) {
				delete(settings, dk)
			}
		}
		settings[strings.TrimSpace(k)] = v
	}
	names := make([]string, 0, len(settings))
	for k := range settings {
		names = append(names, k)
	}
	sort.Strings(names)
	args := []string{
		"-D", pgdata,
		"-p", strconv.Itoa(port),
		"-c", "listen_addresses=" + listenAddress,
		"-c", "unix_socket_directories=",
	}
	for _, k := range names {
		args = append(args, "-c", k+"="+settings[k])
	}

	offset := fileSize(logFile)
	cmd := exec.Command(filepath.Join(binDir, "postgres"), args...)
	cmd.Dir = dataDir
	cmd.Env = childEnv()
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:    true,            // a terminal Ctrl-C reaches tally, which controls shutdown
		Pdeathsig:  syscall.SIGQUIT, // immediate shutdown if tally dies without stopping it
		Credential: as.credential(),
	}

	c := &Cluster{
		dataDir:  dataDir,
		port:     port,
		password: password,
		logger:   cfg.Logger,
		done:     make(chan struct{}),
	}
	started := make(chan error, 1)
	go func() {
		// Pdeathsig fires when the forking thread exits, so this goroutine
		// keeps its thread for as long as the postmaster lives.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.waitErr = cmd.Wait()
		close(c.done)
	}()
	if err := <-started; err != nil {
		return nil, "", fmt.Errorf("embeddedpg: start postgres: %w", err)
	}
	c.proc = cmd.Process

	version, err := c.waitReady(ctx, cfg.StartTimeout)
	if err == nil {
		return c, version, nil
	}
	c.stopping.Store(true)
	select {
	case <-c.done:
	default:
		c.kill()
	}
	tail := logTail(logFile.Name(), offset)
	if errors.Is(err, errExited) {
		err = fmt.Errorf("embeddedpg: postgres exited during startup (%v); last lines of %s:\n%s", c.waitErr, logFile.Name(), tail)
		switch {
		case strings.Contains(tail, "could not bind") || strings.Contains(tail, "could not create any TCP/IP sockets"):
			err = &bindError{err}
		case strings.Contains(tail, "pre-existing shared memory block") && strings.Contains(tail, "still in use"):
			err = &shmBusyError{err}
		}
		return nil, "", err
	}
	return nil, "", fmt.Errorf("%w; last lines of %s:\n%s", err, logFile.Name(), tail)
}

var errExited = errors.New("postgres exited")

// waitReady polls until the server accepts a connection and returns its
// version.
func (c *Cluster) waitReady(ctx context.Context, timeout time.Duration) (string, error) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	var lastErr error
	for {
		actx, cancel := context.WithTimeout(ctx, connectTimeout)
		conn, err := pgx.Connect(actx, c.URL("postgres"))
		if err == nil {
			var version string
			err = conn.QueryRow(actx, "SHOW server_version").Scan(&version)
			_ = conn.Close(actx)
			cancel()
			if err == nil {
				return version, nil
			}
		}
		cancel()
		lastErr = err // pgx errors name user and database, never the password
		select {
		case <-c.done:
			return "", errExited
		case <-ctx.Done():
			return "", fmt.Errorf("embeddedpg: waiting for postgres to accept connections: %w", context.Cause(ctx))
		case <-deadline.C:
			return "", fmt.Errorf("embeddedpg: postgres did not accept connections within %s (last error: %v)", timeout, lastErr)
		case <-tick.C:
		}
	}
}

// watch logs an exit that was not requested through Stop.
func (c *Cluster) watch() {
	<-c.done
	if !c.stopping.Load() {
		c.logger.Error("postgres exited unexpectedly", "dir", c.dataDir, "port", c.port, "err", c.waitErr)
	}
}

// URL returns the connection URL for database as the superuser:
// postgres://tally:<password>@127.0.0.1:<port>/<database>?sslmode=disable,
// with the password URL-escaped. The result contains the password; do not
// log it.
func (c *Cluster) URL(database string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.UserPassword(superuser, c.password),
		Host:     net.JoinHostPort(listenAddress, strconv.Itoa(c.port)),
		Path:     "/" + database,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Port returns the TCP port the server listens on at 127.0.0.1.
func (c *Cluster) Port() int { return c.port }

// Done returns a channel that is closed when the postmaster process exits for
// any reason, whether through Stop or not.
func (c *Cluster) Done() <-chan struct{} { return c.done }

// Stop performs a fast shutdown (SIGINT to the postmaster) and waits for the
// server to exit. If ctx ends first it sends SIGQUIT (immediate shutdown) and
// then SIGKILL to the server's process group, and returns an error. Stop is
// idempotent: calling it again, or after the server died, returns nil.
func (c *Cluster) Stop(ctx context.Context) error {
	select {
	case <-c.done:
		c.logStopped()
		return nil
	default:
	}
	c.stopping.Store(true)
	if err := c.proc.Signal(syscall.SIGINT); err != nil && !errors.Is(err, os.ErrProcessDone) {
		c.logger.Warn("signal postgres", "dir", c.dataDir, "err", err)
	}
	select {
	case <-c.done:
		c.logStopped()
		return nil
	case <-ctx.Done():
	}
	c.kill()
	c.logStopped()
	return fmt.Errorf("embeddedpg: postgres did not finish a fast shutdown in time (%w); it was killed", context.Cause(ctx))
}

// kill sends SIGQUIT to the postmaster, then SIGKILL to its whole process
// group if it has not exited after a short grace period, and waits for exit.
func (c *Cluster) kill() {
	_ = c.proc.Signal(syscall.SIGQUIT)
	t := time.NewTimer(killGrace)
	defer t.Stop()
	select {
	case <-c.done:
		return
	case <-t.C:
	}
	_ = syscall.Kill(-c.proc.Pid, syscall.SIGKILL)
	<-c.done
}

func (c *Cluster) logStopped() {
	if !c.ready.Load() {
		return
	}
	c.stopLog.Do(func() {
		c.logger.Info("postgres stopped", "dir", c.dataDir, "port", c.port)
	})
}

func freePort() (int, error) {
	l, err := net.Listen("tcp4", net.JoinHostPort(listenAddress, "0"))
	if err != nil {
		return 0, fmt.Errorf("embeddedpg: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func newPassword() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("embeddedpg: generate password: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// childEnv is the environment for initdb and postgres, without PG* variables
// that could redirect them.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return env
}

func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, werr := f.Write(data)
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, serr, cerr, os.Chmod(tmp, perm)); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}

func fileSize(f *os.File) int64 {
	if fi, err := f.Stat(); err == nil {
		return fi.Size()
	}
	return 0
}

// logTail returns the last logTailLines lines written to path after offset.
func logTail(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return "(server log unavailable: " + err.Error() + ")"
	}
	defer f.Close()
	const maxRead = 64 << 10
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > maxRead {
		offset = fi.Size() - maxRead
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return "(server log unavailable: " + err.Error() + ")"
	}
	b, _ := io.ReadAll(f)
	lines := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	out := strings.Join(lines, "\n")
	if strings.TrimSpace(out) == "" {
		return "(server log is empty)"
	}
	return out
}
