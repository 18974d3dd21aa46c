package api_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestReadLimiterRefusesOverEitherBoundAndFreesOnRelease(t *testing.T) {
	t.Parallel()
	l, err := api.NewReadLimiter(2, 3, nil)
	require.NoError(t, err)
	r1, ok := l.Acquire(1)
	require.True(t, ok)
	r2, ok := l.Acquire(1)
	require.True(t, ok)
	_, ok = l.Acquire(1)
	require.False(t, ok, "a third read of one token is over its bound")
	r3, ok := l.Acquire(2)
	require.True(t, ok, "another token has slots of its own")
	_, ok = l.Acquire(3)
	require.False(t, ok, "the node is at its global bound")
	r1()
	r1() // a second release gives nothing back
	r4, ok := l.Acquire(3)
	require.True(t, ok)
	_, ok = l.Acquire(4)
	require.False(t, ok, "a double release must not free a second slot")
	for _, release := range []func(){r2, r3, r4} {
		release()
	}
	_, err = api.NewReadLimiter(0, 1, nil)
	require.Error(t, err)
}

func TestExpensiveReadOverTheTokensBoundAnswers429WithRetryAfterAtOnce(t *testing.T) {
	t.Parallel()
	l, err := api.NewReadLimiter(1, 10, nil)
	require.NoError(t, err)
	h := newHarnessWith(t, false, func(d *api.Deps) { d.ReadLimit = l })
	secret := h.token("finance", auth.RoleFinance)
	p, err := auth.Verify(h.ctx, h.pool, secret)
	require.NoError(t, err)
	release, ok := l.Acquire(p.TokenID) // a report of this token in flight
	require.True(t, ok)

	for _, path := range []string{"/v1/reports/completeness?period=2026-11", "/v1/quarantine", "/v1/reconcile/runs"} {
		resp := h.request(http.MethodGet, path, h.as(secret), nil)
		require.Equal(t, http.StatusTooManyRequests, resp.status, "%s: %s", path, resp)
		require.Equal(t, "too_many_reads", resp.errorCode(t))
		require.Equal(t, "2", resp.header.Get("Retry-After"))
	}
	resp := h.request(http.MethodGet, "/v1/outbox/summary", h.as(secret), nil)
	require.Equal(t, http.StatusOK, resp.status, "a cheap read is not bounded: %s", resp)
	resp = h.request(http.MethodGet, "/v1/quarantine", h.as("not-a-token"), nil)
	require.Equal(t, http.StatusUnauthorized, resp.status, "an unknown token is answered 401, holding no slot: %s", resp)

	release()
	resp = h.request(http.MethodGet, "/v1/reports/completeness?period=2026-11", h.as(secret), nil)
	require.Equal(t, http.StatusOK, resp.status, "the slot is free again: %s", resp)
}

func TestGetsRunOnTheReadsPoolAndWritesNever(t *testing.T) {
	t.Parallel()
	var reads *pgxpool.Pool
	h := newHarnessWith(t, false, func(d *api.Deps) {
		var err error
		reads, err = pgxpool.New(context.Background(), testdb.URLOf(t, d.Pool))
		require.NoError(t, err)
		reads.Close() // a reads pool that cannot serve: what runs on it fails
		d.Reads = reads
	})
	fin := h.token("finance", auth.RoleFinance)
	ing := h.token("ingest", auth.RoleIngest)

	resp := h.try(http.MethodGet, "/v1/outbox/summary", h.as(fin), nil)
	require.Equal(t, http.StatusInternalServerError, resp.status, "a GET, its token check included, runs on the reads pool: %s", resp)
	resp = h.request(http.MethodPost, "/v1/usage", h.as(ing), batch(event{"id": "r1", "tenant": "acme", "feature": "api", "value": 1}))
	require.Equal(t, http.StatusAccepted, resp.status, "a write runs on Pool: %s", resp)
}
