// Package pgdb names the database handles Tally's packages take, in three
// shapes: Querier runs statements, Beginner also opens a transaction (a
// savepoint inside one), and DB opens top-level transactions with options
// and sends batches. A *pgxpool.Pool and a *pgx.Conn are all three; a
// pgx.Tx is a Querier and a Beginner. A function asks for the smallest
// shape it needs, so that a caller can see from its signature whether it
// may run inside the caller's transaction.
//
// It is a leaf: it imports pgx/v5 and nothing of Tally, and it only
// declares interfaces. It must never hold a pool, run SQL or wrap pgx.
package pgdb

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier runs SQL: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. Given a
// transaction, its statements are part of it.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Beginner is a Querier that opens a transaction: a *pgxpool.Pool or a
// *pgx.Conn, or a pgx.Tx, whose Begin is a savepoint.
type Beginner interface {
	Querier
	Begin(ctx context.Context) (pgx.Tx, error)
}

// DB is a Beginner that opens transactions of its own, with options such
// as the isolation level, and sends batches of statements in one round
// trip: a *pgxpool.Pool or a *pgx.Conn, never a transaction. A function
// that takes a DB commits its own work before it returns.
type DB interface {
	Beginner
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}
