//go:build unix

package embeddedpg

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// secrets are what tally's environment holds that PostgreSQL must never
// see.
var secrets = map[string]string{
	"TALLY_ADMIN_TOKEN":     "admin-token-never-in-postgres",
	"STRIPE_API_KEY":        "sk_test_never_in_postgres",
	"STRIPE_WEBHOOK_SECRET": "whsec_never_in_postgres",
}

// TestServerEnvironmentHoldsNoSecrets: tally's secrets are in its
// environment, yet neither the postmaster's nor a backend's environment
// (read in /proc, where the server's user reads it too) nor a program the
// server runs (COPY … FROM PROGRAM, which a superuser may) holds them; the
// postmaster's environment holds only allow-listed names. Not parallel:
// it sets the process's environment.
func TestServerEnvironmentHoldsNoSecrets(t *testing.T) {
	for name, value := range secrets {
		t.Setenv(name, value)
	}
	c := startCluster(t, Config{DataDir: tempDataDir(t), Ephemeral: true, Logger: quietLogger()})
	conn := connect(t, c)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "CREATE TEMP TABLE env (line text); COPY env FROM PROGRAM 'env'"); err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{
		"COPY FROM PROGRAM": queryString(t, conn, "SELECT string_agg(line, E'\\n') FROM env"),
	}
	if runtime.GOOS == "linux" {
		backend := queryString(t, conn, "SELECT pg_backend_pid()::text")
		for what, pid := range map[string]string{"postmaster": strconv.Itoa(c.proc.Pid), "backend": backend} {
			b, err := os.ReadFile("/proc/" + pid + "/environ")
			if err != nil {
				t.Fatal(err)
			}
			seen[what] = strings.ReplaceAll(string(b), "\x00", "\n")
		}
	}
	for what, env := range seen {
		for name, value := range secrets {
			if strings.Contains(env, name) || strings.Contains(env, value) {
				t.Errorf("%s's environment holds %s", what, name)
			}
		}
	}
	if env, ok := seen["postmaster"]; ok {
		for _, kv := range strings.Split(strings.TrimSpace(env), "\n") {
			name, _, _ := strings.Cut(kv, "=")
			if !keptEnv(name) && name != "HOME" {
				t.Errorf("postmaster's environment holds %s, which is not allow-listed", name)
			}
		}
	}
}
