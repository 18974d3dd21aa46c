package embeddedpg

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"time"
)

// Start finds the binaries, runs initdb into DataDir/pgdata if there is no
// PG_VERSION there (superuser "tally", scram-sha-256 authentication, the
// password from DataDir/password, UTF8, locale C), otherwise reuses the
// existing cluster, then starts postgres as a child process listening only on
// 127.0.0.1 with Unix sockets disabled. It refuses a server that another
// process runs on DataDir, and waits (up to 30 s) for the server of a tally
// that was killed to finish shutting down. It returns once the server accepts a
// connection, waiting at most StartTimeout and no longer than ctx allows. If
// the server exits during startup the error includes the last lines of
// DataDir/postgres.log. On Windows it returns an error matching
// errors.ErrUnsupported that points at TALLY_DATABASE_URL.
//
// With Config.Workers, it starts a Citus coordinator and its workers
// instead (startCitus).
func Start(ctx context.Context, cfg Config) (c *Cluster, err error) {
	cfg, err = cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := checkPlatform(); err != nil {
		return nil, err
	}
	if cfg.Workers > 0 {
		return startCitus(ctx, cfg)
	}
	return start(ctx, cfg, nil)
}

// start starts the one server of cfg, a node of a Citus cluster when node
// is not nil.
func start(ctx context.Context, cfg Config, node *citusNode) (c *Cluster, err error) {
	s := &starter{cfg: cfg, pgdata: filepath.Join(cfg.DataDir, pgdataName), node: node}
	if cfg.BinDir != "" {
		s.binDir = cfg.BinDir
	} else if s.binDir, err = FindBinaries(); err != nil {
		return nil, err
	}
	if s.as, err = prepareDataDir(cfg); err != nil {
		return nil, err
	}
	if s.lock, err = lockDataDir(cfg.DataDir, s.pgdata); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.lock.release() // on success the cluster holds it
		}
	}()
	if s.logFile, err = openServerLog(cfg.DataDir, s.as); err != nil {
		return nil, err
	}
	defer s.logFile.Close() // the children keep their own descriptors

	password, err := s.ensureCluster(ctx)
	if err != nil {
		return nil, err
	}
	if s.as != nil {
		if err := checkOwner(s.pgdata, s.as); err != nil {
			return nil, err
		}
	}
	if err := checkRunningPostmaster(ctx, s.pgdata, cfg.Logger); err != nil {
		return nil, err
	}
	if node != nil {
		if err := s.prepareNode(password); err != nil {
			return nil, err
		}
	}
	return s.run(ctx, password)
}

// starter carries what the steps of Start share.
type starter struct {
	cfg     Config     // with defaults; DataDir is absolute
	binDir  string     // holds initdb and postgres
	pgdata  string     // DataDir/pgdata, the cluster
	logFile *os.File   // DataDir/postgres.log, the children's output
	as      *runAs     // the unprivileged user when tally is root, else nil
	lock    *dirLock   // DataDir's lock, handed to the cluster that comes up
	node    *citusNode // what a node of a Citus cluster adds; nil otherwise
}

// run launches the server on the cluster, trying again on another free
// port when the picked one was taken in the meantime, and for a while when
// the shared memory of a server killed a moment ago is still attached.
func (s *starter) run(ctx context.Context, password string) (*Cluster, error) {
	attempts := portAttempts
	if s.node != nil {
		attempts = lowPortAttempts
	}
	for attempt := 1; ; attempt++ {
		port := s.cfg.Port
		if port == 0 {
			var err error
			if s.node != nil {
				port, err = s.node.pickPort(attempt)
			} else {
				port, err = freePort()
			}
			if err != nil {
				return nil, err
			}
		}
		c, version, err := s.launch(ctx, port, password)
		if err == nil {
			if s.node != nil {
				s.node.started(c, s.cfg.DataDir)
			}
			c.ready.Store(true)
			s.cfg.Logger.Info("postgres started", "dir", s.cfg.DataDir, "port", port, "version", version)
			go c.watch()
			return c, nil
		}
		var be *bindError
		if s.cfg.Port == 0 && errors.As(err, &be) && attempt < attempts {
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
