package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// citusSettings are the server settings of every node of a Citus cluster:
// Citus preloaded, its connections between the nodes on loopback without
// TLS (a node names itself by the address the password file holds, as a
// shard move connects to itself), prepared transactions for its two-phase
// commit, and logical decoding, which shard moves replicate through.
// Config.Settings overrides them.
var citusSettings = map[string]string{
	"shared_preload_libraries":  "citus",
	"citus.node_conninfo":       "sslmode=disable",
	"citus.local_hostname":      listenAddress,
	"max_prepared_transactions": defaultMaxConns,
	"wal_level":                 "logical",
}

// The ports of a Citus cluster's nodes are picked below the kernels'
// ephemeral ranges (Linux's 32768–60999, macOS's 49152–65535): the nodes
// open many connections to each other, and a port the kernel may hand to
// one as its local end can be taken between the pick and the bind.
const (
	lowPortMin      = 20000
	lowPortMax      = 32767
	lowPortAttempts = 10
	lowPortProbes   = 50
	// portName is the file in a node's data directory that holds the
	// port it last listened on, which it tries first at the next start.
	portName = "port"
	// pgpassName is the password file a node's server connects to the
	// other nodes with (PGPASSFILE), owned by the user that runs it.
	pgpassName = "pgpass"
	// workerDirPrefix names the workers' data directories in the
	// coordinator's: worker1, worker2, ….
	workerDirPrefix = "worker"
)

// citusNode is what a node of a Citus cluster adds to a start.
type citusNode struct {
	password string   // a worker's: its coordinator's; empty for the coordinator
	lastPort int      // the port in DataDir/port, 0 when none
	env      []string // PGPASSFILE, for the server's connections to the other nodes
}

// startCitus starts a Citus coordinator in cfg.DataDir and cfg.Workers
// workers in DataDir/worker1, …, each a cluster of its own with the
// coordinator's password, every node with citusSettings; then, in every
// database of the coordinator that has the extension, it adds the workers
// again, at the ports they now listen on (registerCitus).
func startCitus(ctx context.Context, cfg Config) (*Cluster, error) {
	if err := checkCitus(cfg.BinDir); err != nil {
		return nil, err
	}
	node := cfg
	node.Workers = 0
	c, err := start(ctx, node, &citusNode{})
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Cluster, error) {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*killGrace)
		defer cancel()
		_ = c.Stop(sctx)
		return nil, err
	}
	c.workerCfg = node
	c.workerCfg.Port = 0
	for i := 1; i <= cfg.Workers; i++ {
		wc, err := c.startWorker(ctx, filepath.Join(cfg.DataDir, workerDirPrefix+strconv.Itoa(i)))
		if err != nil {
			return fail(err)
		}
		c.workers = append(c.workers, wc)
	}
	if err := c.reregister(ctx); err != nil {
		return fail(err)
	}
	return c, nil
}

// Workers returns a Citus coordinator's worker nodes, none for a plain
// server. Stopping the coordinator stops them.
func (c *Cluster) Workers() []*Cluster {
	c.workersMu.Lock()
	defer c.workersMu.Unlock()
	return slices.Clone(c.workers)
}

// startWorker starts the worker whose data directory is dir.
func (c *Cluster) startWorker(ctx context.Context, dir string) (*Cluster, error) {
	cfg := c.workerCfg
	cfg.DataDir = dir
	return start(ctx, cfg, &citusNode{password: c.password})
}

// RestartWorker stops a Citus coordinator's worker i (from 0) with a fast
// shutdown, waits pause, and starts it again in its data directory: at the
// port it listened on when that is still free, else at another, which
// every database with the extension is then told (a worker down meanwhile
// is what a crashed or rebooted worker machine looks like to Tally).
func (c *Cluster) RestartWorker(ctx context.Context, i int, pause time.Duration) error {
	c.workersMu.Lock()
	defer c.workersMu.Unlock()
	if i < 0 || i >= len(c.workers) {
		return fmt.Errorf("embeddedpg: no worker %d of %d", i, len(c.workers))
	}
	old := c.workers[i]
	if err := old.stop(ctx); err != nil {
		return err
	}
	select {
	case <-time.After(pause):
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	w, err := c.startWorker(ctx, old.dataDir)
	if err != nil {
		return err
	}
	c.workers[i] = w
	if w.port == old.port {
		return nil
	}
	return c.reregisterLocked(ctx)
}

// checkCitus makes sure binDir's PostgreSQL has Citus installed.
func checkCitus(binDir string) error {
	out, err := exec.Command(filepath.Join(binDir, "pg_config"), "--sharedir").Output()
	if err != nil {
		return fmt.Errorf("embeddedpg: no PostgreSQL with Citus in %s (its pg_config: %v); make citus builds one", binDir, err)
	}
	control := filepath.Join(strings.TrimSpace(string(out)), "extension", "citus.control")
	if _, err := os.Stat(control); err != nil {
		return fmt.Errorf("embeddedpg: the PostgreSQL of %s has no Citus (no %s); make citus builds one", binDir, control)
	}
	return nil
}

// prepareNode reads the port the node last listened on and writes the
// password file its server connects to the other nodes with: the cluster's
// one password for every node, role and database on loopback. The file is
// made anew, owned by the user that runs the server, so that nothing
// planted in its place is written through.
func (s *starter) prepareNode(password string) error {
	if b, err := readFile(filepath.Join(s.cfg.DataDir, portName)); err == nil {
		s.node.lastPort, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	path := filepath.Join(s.cfg.DataDir, pgpassName)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("embeddedpg: %w", err)
	}
	f, err := openFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("embeddedpg: password file of the Citus nodes: %w", err)
	}
	_, werr := f.WriteString(listenAddress + ":*:*:*:" + password + "\n")
	oerr := s.as.chown(f)
	cerr := f.Close()
	if err := errors.Join(werr, oerr, cerr); err != nil {
		return fmt.Errorf("embeddedpg: password file of the Citus nodes: %w", err)
	}
	s.node.env = []string{"PGPASSFILE=" + path}
	return nil
}

// pickPort is the port of a start's attempt: the one the node last
// listened on first, then free ones below the ephemeral ranges.
func (n *citusNode) pickPort(attempt int) (int, error) {
	if attempt == 1 && n.lastPort > 0 {
		return n.lastPort, nil
	}
	return lowPort()
}

// started records the port c came up on, for the next start and for
// registerCitus. A port that could not be written is picked anew next time.
func (n *citusNode) started(c *Cluster, dataDir string) {
	c.lastPort = n.lastPort
	_ = writeFileAtomic(filepath.Join(dataDir, portName), []byte(strconv.Itoa(c.port)+"\n"), 0o644)
}

// lowPort returns a port between lowPortMin and lowPortMax that was free a
// moment ago.
func lowPort() (int, error) {
	for range lowPortProbes {
		p := lowPortMin + rand.IntN(lowPortMax-lowPortMin+1)
		l, err := net.Listen("tcp4", net.JoinHostPort(listenAddress, strconv.Itoa(p)))
		if err == nil {
			_ = l.Close()
			return p, nil
		}
	}
	return 0, fmt.Errorf("embeddedpg: no free port between %d and %d", lowPortMin, lowPortMax)
}

// reregister runs EnsureDatabase for every database of the coordinator
// that has the extension, so that each knows its workers where they listen
// now.
func (c *Cluster) reregister(ctx context.Context) error {
	c.workersMu.Lock()
	defer c.workersMu.Unlock()
	return c.reregisterLocked(ctx)
}

// reregisterLocked is reregister with workersMu held.
func (c *Cluster) reregisterLocked(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	rows, err := conn.Query(ctx, "SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate ORDER BY datname")
	var names []string
	if err == nil {
		names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	_ = conn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return fmt.Errorf("reading the embedded postgres' databases: %w", err)
	}
	for _, name := range names {
		has, err := c.hasCitus(ctx, name)
		if err != nil {
			return err
		}
		if has {
			if err := c.EnsureDatabase(ctx, name); err != nil {
				return err
			}
		}
	}
	return nil
}

func (c *Cluster) hasCitus(ctx context.Context, database string) (bool, error) {
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		return false, fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var has bool
	err = conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')").Scan(&has)
	if err != nil {
		return false, fmt.Errorf("reading the extensions of %s: %w", database, err)
	}
	return has, nil
}

// registerCitus creates the extension in database on every node, unless
// it is there, and makes the coordinator's metadata in it name the
// coordinator and each worker at the port it listens on: a worker known at
// another port (the one it listened on before this start) is moved there
// (citus_update_node), an unknown one is added. Citus's metadata is per
// database, so every database the workers serve needs this once, and again
// after a node's port changed; it changes nothing otherwise.
func (c *Cluster) registerCitus(ctx context.Context, database string) error {
	for _, n := range append(slices.Clone(c.workers), c) {
		if err := n.exec(ctx, database, "CREATE EXTENSION IF NOT EXISTS citus"); err != nil {
			return err
		}
	}
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		return fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	nodeAt := func(port int) (id int, ok bool, err error) {
		err = conn.QueryRow(ctx, "SELECT nodeid FROM pg_dist_node WHERE nodename = $1 AND nodeport = $2", listenAddress, port).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, false, nil
		}
		return id, err == nil, err
	}
	// The coordinator first when the metadata has none (a new database),
	// last when it moved: naming it syncs the metadata to the workers,
	// which must be reached where they listen now.
	var coordinator int
	err = conn.QueryRow(ctx, "SELECT coalesce(max(nodeport), 0) FROM pg_dist_node WHERE groupid = 0").Scan(&coordinator)
	if err == nil && coordinator == 0 {
		err = c.nameCoordinator(ctx, conn)
	}
	if err != nil {
		return fmt.Errorf("naming the Citus coordinator in %s: %w", database, err)
	}
	for _, w := range c.workers {
		_, ok, err := nodeAt(w.port)
		if err == nil && !ok && w.lastPort != 0 && w.lastPort != w.port {
			var id int
			if id, ok, err = nodeAt(w.lastPort); err == nil && ok {
				_, err = conn.Exec(ctx, "SELECT citus_update_node($1, $2, $3)", id, listenAddress, w.port)
			}
		}
		if err == nil && !ok {
			_, err = conn.Exec(ctx, "SELECT citus_add_node($1, $2)", listenAddress, w.port)
		}
		if err != nil {
			return fmt.Errorf("adding the Citus worker on port %d in %s: %w", w.port, database, err)
		}
	}
	if coordinator != 0 && coordinator != c.port {
		if err := c.nameCoordinator(ctx, conn); err != nil {
			return fmt.Errorf("naming the Citus coordinator in %s: %w", database, err)
		}
	}
	return nil
}

func (c *Cluster) nameCoordinator(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, "SELECT citus_set_coordinator_host($1, $2)", listenAddress, c.port)
	return err
}

// exec runs one statement in database as the superuser.
func (c *Cluster) exec(ctx context.Context, database, sql string) error {
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		return fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, sql); err != nil {
		return fmt.Errorf("%s in %s on port %d: %w", sql, database, c.port, err)
	}
	return nil
}

// ErrNoCitus is wrapped in the error FindCitus returns when `make citus`
// has built no PostgreSQL with Citus.
var ErrNoCitus = errors.New("no PostgreSQL with Citus built")

// FindCitus returns the bin directory (initdb, postgres, pg_config) of the
// PostgreSQL prefix with Citus that `make citus` builds: the last, by
// name, of the complete CitusCache()/citus-*/lib/postgresql/*/bin. If
// there is none it returns an error wrapping ErrNoCitus that says to run
// make citus.
func FindCitus() (string, error) {
	root := CitusCache()
	dirs, _ := filepath.Glob(filepath.Join(root, "citus-*", "lib", "postgresql", "*", "bin"))
	slices.Sort(dirs)
	for _, dir := range slices.Backward(dirs) {
		prefix := filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(dir))))
		if _, err := os.Stat(filepath.Join(prefix, ".complete")); err == nil && hasServerBinaries(dir) {
			return dir, nil
		}
	}
	return "", fmt.Errorf("%w in %s: run make citus", ErrNoCitus, root)
}

// CitusCache is the directory `make citus` (deploy/citus/build.sh) builds
// its prefixes in: $XDG_CACHE_HOME/tally; as root without XDG_CACHE_HOME,
// /var/cache/tally, which the unprivileged user that runs the servers can
// reach, unlike root's home; otherwise ~/.cache/tally.
func CitusCache() string {
	if d := os.Getenv("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "tally")
	}
	if os.Geteuid() == 0 {
		return "/var/cache/tally"
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "tally")
}
