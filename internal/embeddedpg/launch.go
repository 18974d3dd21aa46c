package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// shmBusyError reports that the server found the shared memory of an
// earlier server on the data directory still attached: the backends of a
// killed postmaster that have not exited yet.
type shmBusyError struct{ err error }

func (e *shmBusyError) Error() string { return e.err.Error() }
func (e *shmBusyError) Unwrap() error { return e.err }

// bindError reports that the server could not bind its port.
type bindError struct{ err error }

func (e *bindError) Error() string { return e.err.Error() }
func (e *bindError) Unwrap() error { return e.err }

var errExited = errors.New("postgres exited")

// launch starts postgres on port and waits until it accepts a connection.
// It returns the running cluster and the server's version, or, when the
// server does not come up, an error carrying the end of the server log: a
// *bindError when the port was taken, a *shmBusyError when an earlier
// server's shared memory was still attached.
func (s *starter) launch(ctx context.Context, port int, password string) (*Cluster, string, error) {
	offset := fileSize(s.logFile)
	cmd := exec.Command(filepath.Join(s.binDir, "postgres"), s.serverArgs(port)...)
	cmd.Dir = s.cfg.DataDir
	cmd.Env = childEnv(s.as)
	if s.node != nil {
		cmd.Env = append(cmd.Env, s.node.env...)
	}
	cmd.Stdout = s.logFile
	cmd.Stderr = s.logFile
	// Immediate shutdown (SIGQUIT) if tally dies without stopping it, where
	// the kernel offers a parent-death signal; a watchdog otherwise.
	useWatchdog := s.cfg.watchdog || !kernelDeathSignal
	deathSignal := syscall.SIGQUIT
	if useWatchdog {
		deathSignal = 0
	}
	cmd.SysProcAttr = sysProcAttr(s.as, deathSignal)

	c := &Cluster{
		dataDir:  s.cfg.DataDir,
		port:     port,
		password: password,
		logger:   s.cfg.Logger,
		lock:     s.lock,
		done:     make(chan struct{}),
	}
	if err := c.spawn(cmd, s.watchdogStarter(useWatchdog)); err != nil {
		return nil, "", err
	}

	version, err := c.waitReady(ctx, s.cfg.StartTimeout)
	if err == nil {
		return c, version, nil
	}
	c.stopping.Store(true)
	select {
	case <-c.done:
	default:
		c.kill()
	}
	return nil, "", s.startFailure(err, c.waitErr, offset)
}

// serverArgs are postgres's arguments: the data directory, port, the
// listening settings Start controls, then the package's defaults overridden
// by Config.Settings, sorted by name.
func (s *starter) serverArgs(port int) []string {
	settings := map[string]string{"max_connections": defaultMaxConns}
	if s.cfg.Ephemeral {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	if s.node != nil {
		maps.Copy(settings, citusSettings)
	}
	for k, v := range s.cfg.Settings {
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
		"-D", s.pgdata,
		"-p", strconv.Itoa(port),
		"-c", "listen_addresses=" + listenAddress,
		"-c", "unix_socket_directories=",
	}
	for _, k := range names {
		args = append(args, "-c", k+"="+settings[k])
	}
	return args
}

// watchdogStarter returns how the postmaster's watchdog starts, or nil when
// use is false (the kernel's parent-death signal guards it instead).
func (s *starter) watchdogStarter(use bool) func(pid int) (*watchdog, error) {
	if !use {
		return nil
	}
	return func(pid int) (*watchdog, error) {
		return startWatchdog(pid, filepath.Join(s.pgdata, "postmaster.pid"), s.as, s.logFile)
	}
}

// spawn starts cmd, the postmaster, and then its watchdog when
// startWatchdog is not nil, and has a goroutine wait for the postmaster:
// it records the exit in c.waitErr, releases the watchdog and closes
// c.done.
func (c *Cluster) spawn(cmd *exec.Cmd, startWatchdog func(pid int) (*watchdog, error)) error {
	started := make(chan error, 1)
	go func() {
		// The parent-death signal fires when the forking thread exits, so
		// this goroutine keeps its thread for as long as the postmaster lives.
		runtime.LockOSThread()
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("embeddedpg: start postgres: %w", err)
			return
		}
		var w *watchdog
		if startWatchdog != nil {
			var err error
			if w, err = startWatchdog(cmd.Process.Pid); err != nil {
				_ = killGroup(cmd.Process.Pid)
				_ = cmd.Wait()
				started <- err
				return
			}
		}
		c.proc = cmd.Process
		started <- nil
		c.waitErr = cmd.Wait()
		w.release()
		if c.ready.Load() {
			c.lock.release() // before Done, so that a start after it finds the lock free
		}
		close(c.done)
	}()
	return <-started
}

// startFailure explains why a launched server did not come up: err from
// waitReady, waitErr the server's exit, offset where its log began.
func (s *starter) startFailure(err, waitErr error, offset int64) error {
	logPath := s.logFile.Name()
	tail := logTail(logPath, offset)
	if !errors.Is(err, errExited) {
		return fmt.Errorf("%w; last lines of %s:\n%s", err, logPath, tail)
	}
	err = fmt.Errorf("embeddedpg: postgres exited during startup (%v); last lines of %s:\n%s", waitErr, logPath, tail)
	switch {
	case strings.Contains(tail, "could not bind") || strings.Contains(tail, "could not create any TCP/IP sockets"):
		return &bindError{err}
	case strings.Contains(tail, "pre-existing shared memory block") && strings.Contains(tail, "still in use"):
		return &shmBusyError{err}
	}
	return err
}

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

func freePort() (int, error) {
	l, err := net.Listen("tcp4", net.JoinHostPort(listenAddress, "0"))
	if err != nil {
		return 0, fmt.Errorf("embeddedpg: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
