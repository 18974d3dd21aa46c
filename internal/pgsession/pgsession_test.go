package pgsession_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgsession"
)

func TestDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url, jit, workers string
	}{
		{"postgres://u@h/db", "off", "0"},
		{"postgres://u@h/db?jit=on", "on", "0"}, // the operator's word wins
		{"postgres://u@h/db?jit=off&max_parallel_workers_per_gather=2", "off", "2"},
	} {
		cfg, err := pgxpool.ParseConfig(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		pgsession.Defaults(cfg.ConnConfig.RuntimeParams)
		params := cfg.ConnConfig.RuntimeParams
		if params["jit"] != tc.jit || params["max_parallel_workers_per_gather"] != tc.workers {
			t.Errorf("%s: jit=%q max_parallel_workers_per_gather=%q, want %q and %q", tc.url,
				params["jit"], params["max_parallel_workers_per_gather"], tc.jit, tc.workers)
		}
	}
}
