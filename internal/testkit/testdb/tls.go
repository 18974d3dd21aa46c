package testdb

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/testkit/testcert"
)

var (
	tlsOnce sync.Once
	tlsCA   string // the authority's certificate file; empty until TLS worked
	tlsErr  error
)

// TLS returns url, a URL of this server's from URL, verifying the server
// as a managed Postgres is reached (sslmode=verify-full, sslrootcert): on
// first use it turns TLS on in the throwaway cluster (ALTER SYSTEM, then a
// reload) with a certificate for 127.0.0.1 and localhost signed by an
// authority of its own. It skips t on a server given by EnvURL, whose TLS
// is its operator's.
func TLS(t testing.TB, u string) string {
	t.Helper()
	once.Do(start)
	if srv.cluster == nil {
		t.Skipf("testdb: TLS is set up only on the tests' own cluster, not on %s's server", EnvURL)
	}
	tlsOnce.Do(func() { tlsCA, tlsErr = enableTLS(t) })
	if tlsErr != nil {
		t.Fatalf("testdb: turning TLS on: %v", tlsErr)
	}
	parsed, err := url.Parse(u)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	q := parsed.Query()
	q.Set("sslmode", "verify-full")
	q.Set("sslrootcert", tlsCA)
	parsed.RawQuery = q.Encode()
	return parsed.String()
}

func enableTLS(t testing.TB) (string, error) {
	ca := testcert.NewCA(t)
	pair := ca.Issue(t, 2)
	dir := filepath.Join(srv.dir, "tls")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return "", err
	}
	caFile, certFile, keyFile := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	for _, f := range []struct {
		name string
		data []byte
		mode os.FileMode
	}{{caFile, ca.Cert, 0o644}, {certFile, pair.Cert, 0o644}, {keyFile, pair.Key, 0o600}} {
		if err := os.WriteFile(f.name, f.data, f.mode); err != nil {
			return "", err
		}
	}
	// Postgres reads its key only if the server's user owns it.
	if err := ownByCluster(keyFile); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, stmt := range []string{
		"ALTER SYSTEM SET ssl_cert_file = " + quote(certFile),
		"ALTER SYSTEM SET ssl_key_file = " + quote(keyFile),
		"ALTER SYSTEM SET ssl = on",
		"SELECT pg_reload_conf()",
	} {
		if _, err := srv.admin.Exec(ctx, stmt); err != nil {
			return "", err
		}
	}
	q := srv.base.Query()
	q.Set("sslmode", "verify-full")
	q.Set("sslrootcert", caFile)
	verified := *srv.base
	verified.RawQuery = q.Encode()
	var err error
	for range 100 {
		var conn *pgx.Conn
		if conn, err = pgx.Connect(ctx, verified.String()); err == nil {
			return caFile, conn.Close(ctx)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return "", fmt.Errorf("the server did not take a verified TLS connection after the reload (its log is in %s): %w", srv.dir, err)
}

// quote is a string literal of s for SQL.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
