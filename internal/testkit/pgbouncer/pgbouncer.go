// Package pgbouncer starts Debian's PgBouncer in transaction mode in front
// of a test server, for tests that run Tally through a pooler as a
// managed Postgres is run: a random port on 127.0.0.1, every database of
// the server behind it (a wildcard entry), every role's password checked
// by auth_query against the server, and no startup parameter ignored, so
// that a client sending one is refused as it would be in production. It
// reaches the server over TLS, verifying its certificate, when the
// server's URL does (testdb.TLS).
//
// It is for tests only. When the tests run as root, PgBouncer runs as the
// unprivileged user the test cluster runs as, which it requires.
package pgbouncer

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tallymeter/tally/internal/testkit/syncbuf"
)

// Binary is where Debian's package installs PgBouncer.
const Binary = "/usr/sbin/pgbouncer"

// startTimeout bounds how long Start waits for PgBouncer to listen.
const startTimeout = 10 * time.Second

// Bouncer is one running PgBouncer, stopped when the test that started it
// ends.
type Bouncer struct {
	addr string
	out  *syncbuf.Buffer
}

// Available reports whether PgBouncer is installed (.ci/run installs it).
func Available() bool {
	_, err := exec.LookPath(Binary)
	return err == nil
}

// EnvRequire names the variable that, set, makes a missing PgBouncer fail
// the tests that need it instead of skipping them (.ci/run sets it).
const EnvRequire = "TALLY_REQUIRE_PGBOUNCER"

// Start starts PgBouncer in transaction mode in front of the server of
// server, a URL of a superuser (PgBouncer's auth_user, which reads the
// other roles' password hashes). When PgBouncer is missing it skips t,
// saying so, or fails it under EnvRequire.
func Start(t testing.TB, server string) *Bouncer {
	t.Helper()
	if !Available() {
		if os.Getenv(EnvRequire) != "" {
			t.Fatalf("pgbouncer: %s is missing and %s is set: apt-get install pgbouncer", Binary, EnvRequire)
		}
		t.Skipf("pgbouncer: %s is missing (apt-get install pgbouncer; .ci/run installs it)", Binary)
	}
	u, err := url.Parse(server)
	if err != nil {
		t.Fatalf("pgbouncer: the server's URL: %v", err)
	}
	password, _ := u.User.Password()
	// PgBouncer reaches the server as server's URL does: verifying its
	// certificate when the URL does (testdb.TLS), else in the clear.
	serverTLS := "server_tls_sslmode = disable"
	if q := u.Query(); q.Get("sslmode") == "verify-full" {
		serverTLS = "server_tls_sslmode = verify-full\nserver_tls_ca_file = " + q.Get("sslrootcert")
	}
	port := freePort(t)
	// Not t.TempDir: PgBouncer's user must be able to enter its parent.
	dir, err := os.MkdirTemp("", "tally-pgbouncer-")
	if err != nil {
		t.Fatalf("pgbouncer: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	conf := fmt.Sprintf(`[databases]
* = host=%s port=%s auth_user=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = scram-sha-256
auth_file = %s
auth_query = SELECT usename, passwd FROM pg_shadow WHERE usename = $1
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 60
%s
logfile =
pidfile =
`, u.Hostname(), u.Port(), u.User.Username(), port, filepath.Join(dir, "userlist.txt"), serverTLS)
	files := map[string]string{
		"pgbouncer.ini": conf,
		"userlist.txt":  quote(u.User.Username()) + " " + quote(password) + "\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatalf("pgbouncer: %v", err)
		}
	}
	b := &Bouncer{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), out: new(syncbuf.Buffer)}
	cmd := exec.Command(Binary, filepath.Join(dir, "pgbouncer.ini"))
	cmd.Stdout, cmd.Stderr = b.out, b.out
	if err := unprivileged(cmd, dir); err != nil {
		t.Fatalf("pgbouncer: %v", err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("pgbouncer: starting: %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	for deadline := time.Now().Add(startTimeout); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("tcp", b.addr); err == nil {
			_ = c.Close()
			return b
		}
		select {
		case <-exited:
			t.Fatalf("pgbouncer: exited before listening:\n%s", b.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer: not listening on %s after %s:\n%s", b.addr, startTimeout, b.Log())
		}
	}
}

// quote is s as a string of PgBouncer's auth_file.
func quote(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// URL returns direct, a URL of a database on the server, through b: the
// same role, password, database and parameters, on b's address, in the
// clear (b takes no TLS from its clients; it is on the same machine).
func (b *Bouncer) URL(direct string) string {
	u, err := url.Parse(direct)
	if err != nil {
		panic("pgbouncer: not a URL: " + err.Error())
	}
	u.Host = b.addr
	q := u.Query()
	q.Del("sslrootcert")
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return u.String()
}

// Log returns what PgBouncer logged so far: why it refused a client.
func (b *Bouncer) Log() string { return strings.TrimSpace(b.out.String()) }

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("pgbouncer: a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
