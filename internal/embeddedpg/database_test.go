//go:build unix

package embeddedpg

import (
	"context"
	"sync"
	"testing"
)

// TestEnsureDatabase: a missing database is created, an existing one is
// kept with its contents, a name that needs quoting works, and callers
// racing to create the same database all succeed.
func TestEnsureDatabase(t *testing.T) {
	c := startCluster(t, Config{DataDir: tempDataDir(t), Ephemeral: true, Logger: quietLogger()})
	ctx := context.Background()
	conn := connect(t, c)
	countDatabases := func(name string) string {
		t.Helper()
		var n string
		if err := conn.QueryRow(ctx, "SELECT count(*)::text FROM pg_database WHERE datname = $1", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	if err := c.EnsureDatabase(ctx, "tally"); err != nil {
		t.Fatalf("EnsureDatabase: %v", err)
	}
	if got := countDatabases("tally"); got != "1" {
		t.Fatalf("database tally: %s rows in pg_database", got)
	}
	db := connectTo(t, c, "tally")
	if _, err := db.Exec(ctx, "CREATE TABLE kept (v int)"); err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureDatabase(ctx, "tally"); err != nil {
		t.Fatalf("EnsureDatabase again: %v", err)
	}
	if _, err := db.Exec(ctx, "SELECT FROM kept"); err != nil {
		t.Fatalf("the existing database lost its table: %v", err)
	}

	if err := c.EnsureDatabase(ctx, `Odd "name"; DROP`); err != nil {
		t.Fatalf("EnsureDatabase with a name to quote: %v", err)
	}
	if got := countDatabases(`Odd "name"; DROP`); got != "1" {
		t.Fatalf("quoted name: %s rows in pg_database", got)
	}

	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() { errs <- c.EnsureDatabase(ctx, "raced") })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("racing EnsureDatabase: %v", err)
		}
	}
	if got := countDatabases("raced"); got != "1" {
		t.Fatalf("raced: %s rows in pg_database", got)
	}
}
