package mappings

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Store reads and writes mappings.
type Store struct {
	// Checker, when set, is asked before a feature mapping is written, and
	// gives the mapping its meter's payload keys. Unset (no Stripe key), a
	// mapping that names the same meter keeps the keys read before, and one
	// that names another takes Stripe's defaults; `tally doctor` compares
	// them with the meters once a key is configured.
	Checker MeterChecker
	// RestrictedKey says the node's Stripe key is a restricted key (rk_…).
	// Stripe's v2 API takes only secret keys ("You can only access APIs in
	// the /v2 namespace with secret keys", https://docs.stripe.com/api-v2-overview),
	// so a feature mapping that names ExporterStripeMeterEventStream is
	// refused: none of its items could be sent. The wiring sets it from
	// STRIPE_API_KEY (config.RestrictedKey).
	RestrictedKey bool
}

// Querier runs SQL.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// TxBeginner opens transactions: a pool or a connection.
type TxBeginner interface {
	Querier
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ErrNotFound says there is no mapping by that name.
var ErrNotFound = errors.New("mappings: no such mapping")
