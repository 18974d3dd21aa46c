package pgsession_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgsession"
)

func TestDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url, jit string
	}{
		{"postgres://u@h/db", "off"},
		{"postgres://u@h/db?jit=on", "on"}, // the operator's word wins
		{"postgres://u@h/db?jit=off", "off"},
	} {
		cfg, err := pgxpool.ParseConfig(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		pgsession.Defaults(cfg.ConnConfig.RuntimeParams)
		if got := cfg.ConnConfig.RuntimeParams["jit"]; got != tc.jit {
			t.Errorf("%s: jit=%q, want %q", tc.url, got, tc.jit)
		}
	}
}
