package config_test

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/stripeapi"
)

// devVars is what tally dev writes beside its simulator.
var devVars = map[string]string{
	"STRIPE_API_KEY": "sk_test_devsim0123456789", "STRIPE_API_BASE": "http://127.0.0.1:12111",
	"STRIPE_METER_EVENTS_BASE": "http://127.0.0.1:12111", "STRIPE_WEBHOOK_SECRET": "whsec_dev",
	"TALLY_DATABASE_URL": "postgres://dev@127.0.0.1:5433/tally",
}

// loadAs loads the configuration as the command named (its flag set is
// "tally <command>", as the command line names it) with env and args.
func loadAs(t *testing.T, command string, env map[string]string, args ...string) (config.Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("tally "+command, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	// As the command line chooses: serve and dev never read dev.env.
	flags := config.OperatorFlags
	if command == "serve" || command == "dev" {
		flags = config.Flags
	}
	build := flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(args))
	return build()
}

// devDir is a data directory with the dev.env tally dev writes.
func devDir(t *testing.T) (string, string) {
	t.Helper()
	dir := t.TempDir()
	path, err := config.WriteDevEnv(dir, devVars, "The admin token is in "+filepath.Join(dir, "dev-admin-token"))
	require.NoError(t, err)
	return dir, path
}

// An operator command beside tally dev takes dev's database and simulator
// from dev.env in its data directory, and says so; the file is 0600.
func TestOperatorCommandReadsDevEnv(t *testing.T) {
	t.Parallel()
	dir, path := devDir(t)
	if runtime.GOOS != "windows" {
		fi, err := os.Stat(path)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	}
	c, err := loadAs(t, "requeue", map[string]string{"TALLY_DATA_DIR": dir})
	require.NoError(t, err)
	require.Equal(t, devVars["STRIPE_API_KEY"], c.StripeAPIKey)
	require.Equal(t, devVars["STRIPE_API_BASE"], c.StripeAPIBase)
	require.Equal(t, devVars["STRIPE_METER_EVENTS_BASE"], c.StripeMeterEventsBase)
	require.Equal(t, devVars["STRIPE_WEBHOOK_SECRET"], c.StripeWebhookSecret)
	require.Equal(t, devVars["TALLY_DATABASE_URL"], c.DatabaseURL)
	require.Equal(t, path, c.Dev.EnvFile)
	require.ElementsMatch(t, []string{"TALLY_DATABASE_URL", "STRIPE_API_KEY", "STRIPE_API_BASE", "STRIPE_METER_EVENTS_BASE", "STRIPE_WEBHOOK_SECRET"}, c.Dev.From)

	// The data directory by flag finds it too.
	c, err = loadAs(t, "doctor", nil, "--data-dir", dir)
	require.NoError(t, err)
	require.Equal(t, devVars["STRIPE_API_KEY"], c.StripeAPIKey)
}

// The environment and flags win, a group at a time: a Stripe setting of
// the command line keeps every Stripe setting of dev.env out (a real key
// is never sent to the simulator, nor the simulator's key to Stripe), and
// the database is its own group.
func TestDevEnvYieldsToTheEnvironmentAndFlags(t *testing.T) {
	t.Parallel()
	dir, _ := devDir(t)
	for name, tc := range map[string]struct {
		env      map[string]string
		args     []string
		wantKey  string
		wantBase string
		wantDB   string
	}{
		"a key in the environment": {env: map[string]string{"STRIPE_API_KEY": "sk_test_real0123456789"},
			wantKey: "sk_test_real0123456789", wantBase: stripeapi.DefaultAPIBase, wantDB: devVars["TALLY_DATABASE_URL"]},
		"an account in the environment": {env: map[string]string{"STRIPE_ACCOUNT": "acct_1"},
			wantBase: stripeapi.DefaultAPIBase, wantDB: devVars["TALLY_DATABASE_URL"]},
		"a base by flag": {args: []string{"--stripe-api-base", "http://127.0.0.1:9"},
			wantBase: "http://127.0.0.1:9", wantDB: devVars["TALLY_DATABASE_URL"]},
		"a database in the environment": {env: map[string]string{"TALLY_DATABASE_URL": "postgres://other/tally"},
			wantKey: devVars["STRIPE_API_KEY"], wantBase: devVars["STRIPE_API_BASE"], wantDB: "postgres://other/tally"},
	} {
		env := map[string]string{"TALLY_DATA_DIR": dir}
		for k, v := range tc.env {
			env[k] = v
		}
		c, err := loadAs(t, "reconcile", env, tc.args...)
		require.NoError(t, err, name)
		require.Equal(t, tc.wantKey, c.StripeAPIKey, name)
		require.Equal(t, tc.wantBase, c.StripeAPIBase, name)
		require.Equal(t, tc.wantDB, c.DatabaseURL, name)
	}
}

// serve never sends to a simulator it found on disk, and dev, which
// writes dev.env, never reads a stale one.
func TestServeAndDevIgnoreDevEnv(t *testing.T) {
	t.Parallel()
	dir, _ := devDir(t)
	for _, command := range []string{"serve", "dev"} {
		c, err := loadAs(t, command, map[string]string{"TALLY_DATA_DIR": dir})
		require.NoError(t, err, command)
		require.Empty(t, c.StripeAPIKey, command)
		require.Empty(t, c.DatabaseURL, command)
		require.Empty(t, c.Dev.EnvFile, command)
	}
	c, err := loadAs(t, "requeue", map[string]string{"TALLY_DATA_DIR": t.TempDir()})
	require.NoError(t, err)
	require.Empty(t, c.Dev.EnvFile, "no dev.env, nothing taken")
	require.Empty(t, c.StripeAPIKey)
}

// A dev.env tally dev did not write — others may read it, or a line it
// never writes — stops the command, naming the file and why, never a
// value.
func TestDevEnvNotWrittenByDevIsRefused(t *testing.T) {
	t.Parallel()
	if runtime.GOOS == "windows" {
		t.Skip("no Unix modes")
	}
	dir, path := devDir(t)
	require.NoError(t, os.Chmod(path, 0o644))
	_, err := loadAs(t, "mappings tenants", map[string]string{"TALLY_DATA_DIR": dir})
	require.ErrorContains(t, err, path+" has mode 0644: group or others may read or change it")
	require.NotContains(t, err.Error(), devVars["STRIPE_API_KEY"])

	dir = t.TempDir()
	path = filepath.Join(dir, config.DevEnvFile)
	require.NoError(t, os.WriteFile(path, []byte("STRIPE_API_KEY=sk_test_x0123456789\nLD_PRELOAD=/tmp/evil.so\n"), 0o600))
	_, err = loadAs(t, "requeue", map[string]string{"TALLY_DATA_DIR": dir})
	require.ErrorContains(t, err, path+", line 2: not NAME=value of a variable tally dev writes")
	require.NotContains(t, err.Error(), "evil")
}

// serve (and dev, and anything built with Flags, as the tests' nodes are)
// never reads dev.env: a service must not send to a simulator it found on
// disk.
func TestServiceNeverReadsDevEnv(t *testing.T) {
	t.Parallel()
	dir, _ := devDir(t)
	for _, command := range []string{"serve", "dev"} {
		c, err := loadAs(t, command, map[string]string{"TALLY_DATA_DIR": dir})
		require.NoError(t, err, command)
		require.Empty(t, c.StripeAPIKey, command)
		require.Empty(t, c.DatabaseURL, command)
		require.Empty(t, c.Dev.EnvFile, command)
	}
}
