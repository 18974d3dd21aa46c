package embeddedpg

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"time"
)

// Config describes the cluster Start creates or reuses.
type Config struct {
	// DataDir is required. Start uses DataDir/pgdata for the cluster,
	// DataDir/postgres.log for the server log, DataDir/password (mode 0600)
	// for the superuser password generated at initdb and DataDir/tally.lock
	// to know whether a live process runs the server. DataDir is created with
	// mode 0755 when missing. It and its ancestors must be owned by root or
	// by the user tally runs as and not be writable by group (but the
	// owner's private group) or others (a sticky ancestor such as /tmp is
	// fine); Start refuses any other.
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
	// They override the package's defaults (max_connections=200, when
	// Ephemeral the durability settings, and with Workers Citus's). The
	// default is none. port, listen_addresses and unix_socket_directories
	// are controlled by Start and may not be set here.
	Settings map[string]string

	// Workers is how many Citus worker nodes Start runs beside the server,
	// which becomes their coordinator (citus.go): worker i, from 1, is a
	// cluster of its own in DataDir/worker<i>, with the coordinator's
	// password, on a port of its own. Every node preloads Citus, so BinDir
	// is required. The default, 0, is a plain PostgreSQL server.
	Workers int

	// BinDir is the directory holding initdb and postgres. The default, "",
	// is the one FindBinaries returns. With Workers it must hold a
	// PostgreSQL with Citus installed (FindCitus finds the one `make citus`
	// builds).
	BinDir string

	// watchdog makes the server's parent-death guard the watchdog process
	// even where the kernel offers a parent-death signal, so that the tests
	// exercise on Linux the path macOS takes. The default is false.
	watchdog bool
}

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
	unreachableAdvice = "set TALLY_DATA_DIR to a directory it can reach, e.g. /var/lib/tally"
)

// How often, and how far apart, a start is tried again while an earlier
// server's shared memory is still attached (5 s in all).
const (
	shmAttempts   = 25
	shmRetryDelay = 200 * time.Millisecond
)

// reservedSettings are server settings Start controls itself; Config.Settings
// may not override them.
var reservedSettings = []string{"port", "listen_addresses", "unix_socket_directories"}

// withDefaults checks cfg and returns it with DataDir made absolute and the
// defaults of StartTimeout and Logger filled in.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.DataDir == "" {
		return cfg, errors.New("embeddedpg: Config.DataDir is required")
	}
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return cfg, fmt.Errorf("embeddedpg: data directory: %w", err)
	}
	cfg.DataDir = dataDir
	if cfg.Port < 0 || cfg.Port > 65535 {
		return cfg, fmt.Errorf("embeddedpg: invalid port %d", cfg.Port)
	}
	for name := range cfg.Settings {
		for _, r := range reservedSettings {
			if strings.EqualFold(strings.TrimSpace(name), r) {
				return cfg, fmt.Errorf("embeddedpg: setting %q is controlled by embeddedpg and cannot be set in Config.Settings", name)
			}
		}
		if name == "" || strings.ContainsAny(name, "= \t\n") {
			return cfg, fmt.Errorf("embeddedpg: invalid setting name %q", name)
		}
	}
	if cfg.Workers < 0 {
		return cfg, fmt.Errorf("embeddedpg: invalid number of workers %d", cfg.Workers)
	}
	if cfg.Workers > 0 && cfg.BinDir == "" {
		return cfg, errors.New("embeddedpg: Config.Workers needs Config.BinDir, a PostgreSQL with Citus (make citus)")
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = defaultTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg, nil
}
