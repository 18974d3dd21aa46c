package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
)

// ensureCluster makes sure DataDir/pgdata holds an initialized cluster and
// returns the superuser password: the one in DataDir/password for an
// existing cluster, a new one for a new cluster.
func (s *starter) ensureCluster(ctx context.Context) (string, error) {
	if _, err := os.Stat(filepath.Join(s.pgdata, "PG_VERSION")); err == nil {
		pw, err := s.readPassword()
		if err == nil && s.node != nil && s.node.password != "" && pw != s.node.password {
			err = fmt.Errorf("embeddedpg: the Citus worker %s belongs to another coordinator (its password differs); remove it to make a new one", s.cfg.DataDir)
		}
		return pw, err
	}
	if err := s.removeEmptyPgdata(); err != nil {
		return "", err
	}
	// initdb into a scratch directory and rename it into place on success, so
	// an interrupted initdb never leaves a half-made cluster behind in pgdata.
	tmp, err := s.makeScratch()
	if err != nil {
		return "", err
	}
	pw, err := newPassword()
	if err != nil {
		return "", err
	}
	if s.node != nil && s.node.password != "" {
		pw = s.node.password // a worker: the coordinator's, so that every node logs in to every other
	}
	if err := writeFileAtomic(s.passwordPath(), []byte(pw+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("embeddedpg: write password file: %w", err)
	}
	pwFile, err := s.initdbPasswordFile(pw)
	if err != nil {
		return "", err
	}
	if pwFile != s.passwordPath() {
		defer os.Remove(pwFile)
	}
	if err := s.runInitdb(ctx, tmp, pwFile); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, s.pgdata); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if !s.cfg.Ephemeral {
		syncDir(s.cfg.DataDir)
	}
	s.cfg.Logger.Debug("initialized postgres cluster", "dir", s.cfg.DataDir)
	return pw, nil
}

func (s *starter) passwordPath() string { return filepath.Join(s.cfg.DataDir, passwordName) }

// readPassword reads the superuser password of the existing cluster.
func (s *starter) readPassword() (string, error) {
	b, err := readFile(s.passwordPath())
	if err != nil {
		return "", fmt.Errorf("embeddedpg: cluster %s exists but its password file cannot be read: %w", s.pgdata, err)
	}
	pw := strings.TrimSpace(string(b))
	if pw == "" {
		return "", fmt.Errorf("embeddedpg: password file %s is empty", s.passwordPath())
	}
	return pw, nil
}

// removeEmptyPgdata removes a pgdata directory without a cluster, which
// initdb will replace, and refuses to touch one that holds anything.
func (s *starter) removeEmptyPgdata() error {
	entries, err := os.ReadDir(s.pgdata)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("embeddedpg: %w", err)
	}
	if len(entries) > 0 {
		return fmt.Errorf("embeddedpg: %s exists but is not a PostgreSQL cluster (no PG_VERSION); refusing to touch it", s.pgdata)
	}
	if err := os.Remove(s.pgdata); err != nil {
		return fmt.Errorf("embeddedpg: %w", err)
	}
	return nil
}

// makeScratch makes an empty DataDir/pgdata.initdb (mode 0700, owned by
// the user that runs PostgreSQL) for initdb, removing any leftover of an
// interrupted one.
func (s *starter) makeScratch() (string, error) {
	tmp := filepath.Join(s.cfg.DataDir, initdbTmpName)
	if err := os.RemoveAll(tmp); err != nil {
		return "", fmt.Errorf("embeddedpg: remove leftover %s: %w", tmp, err)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	d, err := openDir(tmp)
	if err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	defer d.Close()
	if err := errors.Join(d.Chmod(0o700), s.as.chown(d)); err != nil {
		return "", fmt.Errorf("embeddedpg: prepare %s: %w", tmp, err)
	}
	return tmp, nil
}

// initdbPasswordFile returns the file initdb reads the password pw from:
// DataDir/password itself, or, when tally is root, a private copy that the
// unprivileged user owns (it cannot read the root-owned original), which
// the caller removes once initdb is done.
func (s *starter) initdbPasswordFile(pw string) (string, error) {
	if s.as == nil {
		return s.passwordPath(), nil
	}
	f, err := os.CreateTemp(s.cfg.DataDir, ".initdb-pwfile-*")
	if err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	name := f.Name()
	_, werr := f.WriteString(pw + "\n")
	merr := f.Chmod(0o600)
	oerr := s.as.chown(f)
	cerr := f.Close()
	if err := errors.Join(werr, merr, oerr, cerr); err != nil {
		_ = os.Remove(name)
		return "", fmt.Errorf("embeddedpg: prepare initdb password file: %w", err)
	}
	return name, nil
}

// runInitdb runs initdb into tmp: superuser "tally" with the password in
// pwFile, scram-sha-256 authentication, UTF8 and locale C. A failed or
// interrupted initdb leaves no tmp behind.
func (s *starter) runInitdb(ctx context.Context, tmp, pwFile string) error {
	args := []string{
		"-D", tmp,
		"-U", superuser,
		"--pwfile=" + pwFile,
		"--auth-host=scram-sha-256",
		"--auth-local=scram-sha-256",
		"-E", "UTF8",
		"--locale=C",
	}
	if s.cfg.Ephemeral {
		args = append(args, "--no-sync")
	}
	offset := fileSize(s.logFile)
	cmd := exec.CommandContext(ctx, filepath.Join(s.binDir, "initdb"), args...)
	cmd.Dir = s.cfg.DataDir
	cmd.Env = childEnv(s.as)
	cmd.Stdout = s.logFile
	cmd.Stderr = s.logFile
	// A dead tally kills initdb on Linux; elsewhere initdb finishes into
	// pgdata.initdb, which the next start removes.
	cmd.SysProcAttr = sysProcAttr(s.as, syscall.SIGKILL)
	cmd.Cancel = func() error { return killGroup(cmd.Process.Pid) }
	if err := runLocked(cmd); err != nil {
		_ = os.RemoveAll(tmp)
		if ctx.Err() != nil {
			return fmt.Errorf("embeddedpg: initdb interrupted: %w", context.Cause(ctx))
		}
		return fmt.Errorf("embeddedpg: initdb failed (%v); last lines of %s:\n%s", err, s.logFile.Name(), logTail(s.logFile.Name(), offset))
	}
	return nil
}

// runLocked runs cmd from a goroutine locked to its OS thread, because
// the parent-death signal fires when the thread that forked the child exits.
func runLocked(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- cmd.Run()
		// Returning while locked terminates the thread; the child is gone.
	}()
	return <-errc
}
