package embeddedpg

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Attach returns the URL of database on the cluster that another process
// (a running `tally serve` or `tally dev`) started in dataDir, so that a
// command can use it without starting a second server. ok is false when no
// server runs there, and when the one there has lost the process that ran
// it (it is shutting down; Start waits for it).
func Attach(dataDir, database string) (dbURL string, ok bool, err error) {
	dataDir, err = filepath.Abs(dataDir)
	if err != nil {
		return "", false, err
	}
	pid, port, err := readPostmasterPID(filepath.Join(dataDir, pgdataName, "postmaster.pid"))
	if errors.Is(err, os.ErrNotExist) {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	if processGone(pid) || ownerless(dataDir) {
		// Stale, or the server of a tally that was killed, on its way
		// down: whoever starts next cleans up, or waits for it.
		return "", false, nil
	}
	pw, err := readFile(filepath.Join(dataDir, passwordName))
	if err != nil {
		return "", false, fmt.Errorf("embeddedpg: a server runs on %s but its password is unreadable: %w", dataDir, err)
	}
	u := url.URL{
		Scheme:   "postgres",
		User:     url.UserPassword(superuser, strings.TrimSpace(string(pw))),
		Host:     net.JoinHostPort(listenAddress, strconv.Itoa(port)),
		Path:     "/" + database,
		RawQuery: "sslmode=disable",
	}
	return u.String(), true, nil
}

// readPostmasterPID reads the pid (line 1) and the port (line 4) of a
// postmaster.pid file.
func readPostmasterPID(path string) (pid, port int, err error) {
	b, err := readFile(path)
	if err != nil {
		return 0, 0, err
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 4 {
		return 0, 0, fmt.Errorf("embeddedpg: %s is incomplete", path)
	}
	if pid, err = strconv.Atoi(strings.TrimSpace(lines[0])); err != nil {
		return 0, 0, fmt.Errorf("embeddedpg: %s: bad pid", path)
	}
	if port, err = strconv.Atoi(strings.TrimSpace(lines[3])); err != nil {
		return 0, 0, fmt.Errorf("embeddedpg: %s: bad port", path)
	}
	return pid, port, nil
}
