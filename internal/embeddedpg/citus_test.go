//go:build unix

package embeddedpg

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// citusBinDir is the PostgreSQL with Citus that `make citus` built; the
// test is skipped without one, or fails when TALLY_REQUIRE_CITUS is 1.
func citusBinDir(t *testing.T) string {
	t.Helper()
	dir, err := FindCitus()
	if err != nil {
		if os.Getenv("TALLY_REQUIRE_CITUS") == "1" {
			t.Fatalf("TALLY_REQUIRE_CITUS=1: %v", err)
		}
		t.Skipf("%v", err)
	}
	return dir
}

func startCitusCluster(t *testing.T, cfg Config) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := Start(ctx, cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = c.Stop(context.Background()) })
	return c
}

// A coordinator and two workers come up with Citus, each on a port below
// the ephemeral range; a database gets the extension on every node and
// the workers; a second start, with a worker that had to move to another
// port, registers them again, the moved one where it now listens, and the
// distributed table's rows are all still there.
func TestCitusCluster(t *testing.T) {
	bin := citusBinDir(t)
	dir := tempDataDir(t)
	ctx := context.Background()
	cfg := Config{DataDir: dir, Ephemeral: true, Logger: quietLogger(), Workers: 2, BinDir: bin}

	c := startCitusCluster(t, cfg)
	if len(c.Workers()) != 2 {
		t.Fatalf("%d workers, want 2", len(c.Workers()))
	}
	for _, n := range append([]*Cluster{c}, c.Workers()...) {
		if n.Port() < lowPortMin || n.Port() > lowPortMax {
			t.Errorf("a node listens on %d, outside %d–%d", n.Port(), lowPortMin, lowPortMax)
		}
	}
	for i := 1; i <= 2; i++ {
		if _, err := os.Stat(filepath.Join(dir, "worker"+strconv.Itoa(i), "pgdata", "PG_VERSION")); err != nil {
			t.Errorf("worker %d's cluster: %v", i, err)
		}
	}
	if err := c.EnsureDatabase(ctx, "tally"); err != nil {
		t.Fatal(err)
	}
	conn := connectTo(t, c, "tally")
	assertWorkers(t, conn, c)
	for _, sql := range []string{
		"CREATE TABLE spread (k int PRIMARY KEY)",
		"SELECT create_distributed_table('spread', 'k')",
		"INSERT INTO spread SELECT generate_series(1, 100)",
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// A login role made on the coordinator logs in to the workers too,
	// where the coordinator's queries reach them as it.
	if _, err := conn.Exec(ctx, "CREATE ROLE readers; GRANT SELECT ON spread TO readers"); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)
	login, err := c.EnsureLoginRole(ctx, "tally", "reader", "readers")
	if err != nil {
		t.Fatal(err)
	}
	rconn, err := pgx.Connect(ctx, login)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	err = rconn.QueryRow(ctx, "SELECT count(*) FROM spread").Scan(&n)
	_ = rconn.Close(ctx)
	if err != nil || n != 100 {
		t.Fatalf("the login role reads %d rows of the distributed table (%v), want 100", n, err)
	}
	// A second EnsureDatabase changes nothing.
	if err := c.EnsureDatabase(ctx, "tally"); err != nil {
		t.Fatal(err)
	}
	moved := c.Workers()[0].Port()
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	for _, n := range append([]*Cluster{c}, c.Workers()...) {
		assertGone(t, n)
	}

	// The first worker's port is taken while the cluster is down.
	l, err := net.Listen("tcp4", net.JoinHostPort(listenAddress, strconv.Itoa(moved)))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c2 := startCitusCluster(t, cfg)
	if got := c2.Workers()[0].Port(); got == moved {
		t.Fatalf("worker 1 listens on %d, which was taken", got)
	}
	if got, want := c2.Workers()[1].Port(), c.Workers()[1].Port(); got != want {
		t.Errorf("worker 2 moved from %d to %d without cause", want, got)
	}
	conn2 := connectTo(t, c2, "tally")
	assertWorkers(t, conn2, c2)
	if got := queryString(t, conn2, "SELECT count(*)::text FROM spread"); got != "100" {
		t.Fatalf("after the restart the distributed table has %s rows, want 100", got)
	}
}

// A worker restarted under a running coordinator is unreachable while it
// is down — a statement that needs it fails, one that does not still
// runs — and serves its shards again afterwards, at its port, or at
// another one the metadata is moved to when its port was taken.
func TestRestartWorker(t *testing.T) {
	bin := citusBinDir(t)
	ctx := context.Background()
	c := startCitusCluster(t, Config{DataDir: tempDataDir(t), Ephemeral: true, Logger: quietLogger(), Workers: 2, BinDir: bin})
	if err := c.EnsureDatabase(ctx, "tally"); err != nil {
		t.Fatal(err)
	}
	conn := connectTo(t, c, "tally")
	for _, sql := range []string{
		"CREATE TABLE spread (k int PRIMARY KEY)",
		"SELECT create_distributed_table('spread', 'k')",
		"INSERT INTO spread SELECT generate_series(1, 100)",
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if err := c.RestartWorker(ctx, 2, 0); err == nil {
		t.Fatal("RestartWorker(2) of two workers succeeded")
	}

	// While worker 1 is down (the restart pauses), a count of every shard
	// fails and a row on worker 2 is still read.
	port := c.Workers()[0].Port()
	onWorker2 := queryString(t, conn, `SELECT min(k)::text FROM spread s JOIN pg_dist_shard_placement p
		ON p.shardid = get_shard_id_for_distribution_column('spread', s.k) WHERE p.nodeport = `+strconv.Itoa(c.Workers()[1].Port()))
	done := make(chan error, 1)
	go func() { done <- c.RestartWorker(ctx, 0, 2*time.Second) }()
	waitClosed(t, port)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM spread").Scan(&n); err == nil {
		t.Fatalf("a count of every shard with worker 1 down gave %d", n)
	}
	if got := queryString(t, conn, "SELECT k::text FROM spread WHERE k = "+onWorker2); got != onWorker2 {
		t.Fatalf("a row on worker 2 read %q with worker 1 down", got)
	}
	if err := <-done; err != nil {
		t.Fatalf("RestartWorker: %v", err)
	}
	if got := c.Workers()[0].Port(); got != port {
		t.Errorf("worker 1 came back on %d, not its port %d", got, port)
	}
	if got := queryString(t, conn, "SELECT count(*)::text FROM spread"); got != "100" {
		t.Fatalf("after the restart the table has %s rows, want 100", got)
	}

	// Its port taken while it is down, it comes back elsewhere and the
	// metadata follows.
	done = make(chan error, 1)
	port = c.Workers()[1].Port()
	go func() { done <- c.RestartWorker(ctx, 1, time.Second) }()
	waitClosed(t, port)
	l, err := net.Listen("tcp4", net.JoinHostPort(listenAddress, strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := <-done; err != nil {
		t.Fatalf("RestartWorker onto a taken port: %v", err)
	}
	if got := c.Workers()[1].Port(); got == port {
		t.Fatalf("worker 2 listens on %d, which was taken", got)
	}
	assertWorkers(t, conn, c)
	if got := queryString(t, conn, "SELECT count(*)::text FROM spread"); got != "100" {
		t.Fatalf("after the move the table has %s rows, want 100", got)
	}
}

// waitClosed waits until nothing listens on port.
func waitClosed(t *testing.T, port int) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		c, err := net.Dial("tcp4", net.JoinHostPort(listenAddress, strconv.Itoa(port)))
		if err != nil {
			return
		}
		_ = c.Close()
	}
	t.Fatalf("port %d still listens", port)
}

// assertWorkers checks that the metadata of conn's database names the
// coordinator and exactly c's workers, at their ports, active.
func assertWorkers(t *testing.T, conn *pgx.Conn, c *Cluster) {
	t.Helper()
	rows, err := conn.Query(context.Background(),
		"SELECT nodeport FROM pg_dist_node WHERE isactive AND noderole = 'primary' AND groupid > 0 ORDER BY nodeport")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	want := map[int32]bool{}
	for _, w := range c.Workers() {
		want[int32(w.Port())] = true
	}
	if len(got) != len(want) {
		t.Fatalf("workers at ports %v, want %v", got, want)
	}
	for _, p := range got {
		if !want[p] {
			t.Fatalf("workers at ports %v, want %v", got, want)
		}
	}
	if got := queryString(t, conn, "SELECT nodeport::text FROM pg_dist_node WHERE groupid = 0"); got != strconv.Itoa(c.Port()) {
		t.Fatalf("coordinator at port %s, want %d", got, c.Port())
	}
}

// Every node of a Citus cluster goes down with the process that started
// it, as the one server does.
func TestCitusDiesWithParent(t *testing.T) {
	t.Setenv("EMBEDDEDPG_HELPER_CITUS", citusBinDir(t))
	dir := tempDataDir(t)
	h := startHelper(t, dir, false)
	var pids []int
	for range 3 {
		pids = append(pids, h.ready(t))
	}
	h.kill()
	for _, pid := range pids {
		awaitExit(t, pid)
	}
	for _, d := range []string{dir, filepath.Join(dir, "worker1"), filepath.Join(dir, "worker2")} {
		if kernelDeathSignal {
			assertLogged(t, d, "received immediate shutdown request")
		} else {
			assertLogged(t, d, "embeddedpg watchdog: tally exited without stopping postgres", "received fast shutdown request")
		}
	}
}

func TestCitusNeedsCitus(t *testing.T) {
	ctx := context.Background()
	if _, err := Start(ctx, Config{DataDir: tempDataDir(t), Workers: 2}); err == nil {
		t.Fatal("Start with workers and no BinDir succeeded")
	}
	plain, err := FindBinaries()
	if err != nil {
		t.Skip(err)
	}
	_, err = Start(ctx, Config{DataDir: tempDataDir(t), Workers: 1, BinDir: plain, Logger: quietLogger()})
	if err == nil {
		t.Fatal("Start with workers on a PostgreSQL without Citus succeeded")
	}
	if errors.Is(err, ErrNoCitus) {
		t.Fatal("unexpected ErrNoCitus from Start")
	}
	t.Log(err)
}
