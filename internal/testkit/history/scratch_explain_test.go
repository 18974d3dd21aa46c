package history_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

func TestScratchExplain(t *testing.T) {
	if os.Getenv("SCRATCH") == "" {
		t.Skip()
	}
	ctx := context.Background()
	cfg, _ := pgxpool.ParseConfig(testdb.URL(t))
	cfg.MaxConns = 4
	on := false
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if on {
			fmt.Println(n.Message)
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	now := time.Now().UTC()
	if err := history.Map(ctx, pool); err != nil {
		t.Fatal(err)
	}
	size, _ := history.SizeFrom(os.Getenv)
	if os.Getenv("NOLOAD") != "" {
	} else if _, err := history.Load(ctx, pool, size, now); err != nil {
		t.Fatal(err)
	}
	store, _ := outbox.New(outbox.Config{}, nil)
	items := make([]outbox.NewItem, 500)
	for i := range items {
		items[i] = outbox.NewItem{Identity: outbox.Identity{TenantKey: "org-0001", SubjectKind: outbox.SubjectUsageWindow,
			SubjectRef: fmt.Sprintf("x:%d", i), Exporter: history.Exporter, DestinationAccount: history.Account, Mode: history.Mode, MappingVersion: 1},
			Payload: outbox.Payload{Customer: "cus_org0001", EventName: "api_calls", Value: 1, Timestamp: now.Unix() - 3600, Feature: "api_calls", Period: "2026-12-01T00:00:00Z"}}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := store.EnqueueBatch(ctx, tx, items); return err }); err != nil {
		t.Fatal(err)
	}
	conn, _ := pool.Acquire(ctx)
	defer conn.Release()
	for _, s := range []string{"LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_analyze = on",
		"SET auto_explain.log_buffers = on", "SET client_min_messages = log", "SET auto_explain.log_nested_statements = off"} {
		if _, err := conn.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	on = true
	for _, what := range os.Args {
		_ = what
	}
	if os.Getenv("SCRATCH") == "claim" {
		_, err = store.Claim(ctx, conn, outbox.ClaimOptions{Owner: "x", Limit: 100, Policy: outbox.BestEffort})
	}
	if os.Getenv("SCRATCH") == "gauge" {
		_, err = store.ReadGauge(ctx, conn.Conn())
	}
	if os.Getenv("SCRATCH") == "compl" {
		_, err = quarantine.CompletenessOf(ctx, conn.Conn(), now.Format("2006-01"), "")
	}
	on = false
	if err != nil {
		t.Fatal(err)
	}
}
