package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Cluster is a running private PostgreSQL server started by Start.
type Cluster struct {
	dataDir  string
	port     int
	password string
	logger   *slog.Logger
	lock     *dirLock // the data directory's, released when the server exits or Stop returns

	proc    *os.Process
	done    chan struct{}
	waitErr error // written before done is closed

	ready    atomic.Bool
	stopping atomic.Bool
	stopLog  sync.Once

	// workers are a Citus coordinator's worker nodes (citus.go), under
	// workersMu; none on a plain server. lastPort is a Citus node's port
	// before this start; workerCfg is what a coordinator starts its
	// workers with.
	workersMu sync.Mutex
	workers   []*Cluster
	lastPort  int
	workerCfg Config
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
// any reason, whether through Stop or not; a Citus coordinator's, not its
// workers'. Start may start the data directory's server again once Done is
// closed or Stop has returned.
func (c *Cluster) Done() <-chan struct{} { return c.done }

// Stop performs a fast shutdown (SIGINT to the postmaster) and waits for the
// server to exit. If ctx ends first it sends SIGQUIT (immediate shutdown) and
// then SIGKILL to the server's process group, and returns an error. Stop is
// idempotent: calling it again, or after the server died, returns nil. A
// Citus coordinator stops first, then its workers.
func (c *Cluster) Stop(ctx context.Context) error {
	err := c.stop(ctx)
	for _, w := range c.Workers() {
		err = errors.Join(err, w.stop(ctx))
	}
	return err
}

func (c *Cluster) stop(ctx context.Context) error {
	defer c.lock.release()
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
	_ = killGroup(c.proc.Pid)
	<-c.done
}

// watch logs an exit that was not requested through Stop.
func (c *Cluster) watch() {
	<-c.done
	c.lock.release() // in case it exited before run marked it ready
	if !c.stopping.Load() {
		c.logger.Error("postgres exited unexpectedly", "dir", c.dataDir, "port", c.port, "err", c.waitErr)
	}
}

func (c *Cluster) logStopped() {
	if !c.ready.Load() {
		return
	}
	c.stopLog.Do(func() {
		c.logger.Info("postgres stopped", "dir", c.dataDir, "port", c.port)
	})
}
