package testdb

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/migrations"
)

// EnvEngine names the variable that, set to "citus", makes New and URL
// give databases distributed on the tests' Citus cluster (a coordinator
// and CitusWorkers workers) instead of plain ones: the same tests then
// prove the same end checks on three nodes.
const EnvEngine = "TALLY_TEST_ENGINE"

// OnCitus reports whether New and URL give distributed Citus databases
// (EnvEngine).
func OnCitus() bool { return os.Getenv(EnvEngine) == "citus" }

var (
	distOnce     sync.Once
	distTemplate string
	distErr      error
)

// NewDistributed is NewCitus with Tally's tables distributed as
// `tally migrate --distribute` places them.
func NewDistributed(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return citusPool(t, DistributedURL(t))
}

// DistributedURL is CitusURL with Tally's tables distributed. The
// distribution runs once, on a template every test's database copies on
// every node.
func DistributedURL(t testing.TB) string {
	t.Helper()
	CitusCluster(t)
	distOnce.Do(func() { distErr = buildDistributedTemplate() })
	if distErr != nil {
		t.Fatalf("testdb: the distributed Citus template: %v", distErr)
	}
	// A copy does not inherit the defaults Distribute set on its template.
	var settings []string
	for _, d := range migrations.DistributedDefaults {
		settings = append(settings, "ALTER DATABASE %s SET "+d.Name+" = "+d.Value)
	}
	return citusCopy(t, distTemplate, settings...)
}

// buildDistributedTemplate copies the migrated template on every node,
// distributes its tables, and closes it to connections as the template is.
func buildDistributedTemplate() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	distTemplate = citusSrv.prefix + "_dtemplate"
	id := pgx.Identifier{distTemplate}.Sanitize()
	for _, admin := range citusSrv.nodes {
		if _, err := admin.Exec(ctx, "CREATE DATABASE "+id+" TEMPLATE "+pgx.Identifier{citusSrv.template}.Sanitize()+" STRATEGY FILE_COPY"); err != nil {
			return fmt.Errorf("copying the template: %w", err)
		}
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+id+" ALLOW_CONNECTIONS true"); err != nil {
			return err
		}
	}
	pool, err := pgxpool.New(ctx, citusSrv.cluster.URL(distTemplate))
	if err != nil {
		return err
	}
	_, err = migrations.Distribute(ctx, pool, nil)
	pool.Close()
	if err != nil {
		return fmt.Errorf("distributing: %w", err)
	}
	for _, admin := range citusSrv.nodes {
		for _, s := range []string{
			"ALTER DATABASE " + id + " ALLOW_CONNECTIONS false",
			"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = " + quote(distTemplate),
		} {
			if _, err := admin.Exec(ctx, s); err != nil {
				return fmt.Errorf("closing the distributed template: %w", err)
			}
		}
	}
	return nil
}
