package meter_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/meter"
)

// monthsAgo is the first instant (UTC) of the month n months before the
// current one.
func monthsAgo(n int) time.Time {
	now := time.Now().UTC()
	return time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC).AddDate(0, -n, 0)
}

func (b *bundle) countOf(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, sql, args...).Scan(&n))
	return n
}

func requirePeriodClosed(t *testing.T, err error, n int) {
	t.Helper()
	var invalid *meter.InvalidBatchError
	require.ErrorAs(t, err, &invalid)
	require.Len(t, invalid.Problems, n)
	for _, p := range invalid.Problems {
		require.Contains(t, p.Reason, meter.PeriodClosed+":", p)
	}
}

// proof is a verified archive of the months before and of month counting
// events of month.
func proof(month time.Time, events int64) meter.DetachProof {
	return meter.DetachProof{
		Previous: meter.VerifiedPeriod{Period: month.AddDate(0, -1, 0), Manifest: "test-prev"},
		Month:    meter.VerifiedPeriod{Period: month, MonthEvents: events, Manifest: "test"},
	}
}

// A month leaves only with the verified archives of both periods whose
// events it holds, counting exactly its rows; then its events, re-posted
// with or without their timestamp, are refused period_closed and nothing
// is stored, while other months flow.
func TestDetachMonthRefusedWithoutVerifiedArchiveThenClosesTheMonth(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := monthsAgo(3)
	t1, t2 := old.Add(36*time.Hour), old.Add(20*24*time.Hour)
	b.MustIngest(t, ev("a", "acme", "api", 1, &t1), ev("b", "acme", "api", 2, &t2), ev("now", "acme", "api", 3, nil))

	for name, c := range map[string]struct {
		month time.Time
		proof meter.DetachProof
	}{
		"no proof":                  {old, meter.DetachProof{}},
		"the month's periods only":  {old, meter.DetachProof{Month: proof(old, 2).Month}},
		"a count short of the rows": {old, proof(old, 1)},
		"a count over the rows":     {old, proof(old, 3)},
	} {
		_, err := meter.DetachMonth(b.Ctx, b.Pool, c.month, c.proof, "test")
		require.ErrorIs(t, err, meter.ErrNotArchived, name)
	}
	_, err := meter.DetachMonth(b.Ctx, b.Pool, monthsAgo(1), proof(monthsAgo(1), 0), "test")
	require.ErrorContains(t, err, "not over", "the month before the current one may still get events of an open period")
	require.Zero(t, b.countOf(t, "SELECT count(*) FROM usage_closed_months"))
	require.Equal(t, 3, b.countOf(t, "SELECT count(*) FROM usage_events"), "a refused detach changes nothing")

	res, err := meter.DetachMonth(b.Ctx, b.Pool, old, proof(old, 2), "operator")
	require.NoError(t, err)
	require.Equal(t, meter.DetachResult{Partition: meter.MonthPartition(old), Events: 2}, res)
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_events"))
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM audit_log WHERE action = 'ledger.detach' AND actor = 'operator' AND subject = $1",
		"ledger:"+old.Format("2006-01")))
	_, err = meter.DetachMonth(b.Ctx, b.Pool, old, proof(old, 2), "operator")
	require.ErrorContains(t, err, "detached already")

	// Re-posts of its events: with their timestamp, and with another one
	// (different content, found by the key); a new event of the month.
	keys := b.countOf(t, "SELECT count(*) FROM usage_event_keys")
	_, err = b.Ingest(t, ev("a", "acme", "api", 1, &t1), ev("b", "acme", "api", 2, at(time.Now().UTC().Format(time.RFC3339))),
		ev("new", "acme", "api", 1, &t2))
	requirePeriodClosed(t, err, 3)
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_events"), "nothing of a refused batch is stored")
	require.Equal(t, keys, b.countOf(t, "SELECT count(*) FROM usage_event_keys"))

	// Nor can they be cancelled.
	err = pgx.BeginFunc(b.Ctx, b.Pool, func(tx pgx.Tx) error {
		_, err := b.Stager.Cancel(b.Ctx, tx, "test", []meter.Cancellation{{Tenant: "acme", ID: "a"}})
		return err
	})
	requirePeriodClosed(t, err, 1)

	// Usage of the current month flows.
	res2 := b.MustIngest(t, ev("now", "acme", "api", 3, nil), ev("later", "acme", "api", 4, nil))
	require.Equal(t, meter.Result{Accepted: 1, Duplicates: 1, Unmapped: 1}, res2)
}

// A re-post finds its event in another month: without a timestamp an event
// is stamped at receipt, so its re-post falls in another month than the
// first post whenever a month ended between them.
func TestDuplicateAcrossMonthsIsADuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := monthsAgo(2).Add(time.Hour)
	// Stored last month without a timestamp (as the ingest would have
	// stamped it then).
	_, err := b.Pool.Exec(b.Ctx, `WITH k AS (INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
			VALUES (nextval('usage_events_id_seq'), $1, md5('e1')::uuid, 'acme', tally_bucket('acme')) RETURNING event_row, bucket)
		INSERT INTO usage_events (id, tenant, event_id, feature, value, occurred_at, timestamp_given, bucket) OVERRIDING SYSTEM VALUE
		SELECT event_row, 'acme', 'e1', 'api', 5, $1, false, bucket FROM k`, old)
	require.NoError(t, err)
	res := b.MustIngest(t, ev("e1", "acme", "api", 5, nil))
	require.Equal(t, meter.Result{Duplicates: 1}, res)
	_, err = b.Ingest(t, ev("e1", "acme", "api", 5, at(time.Now().UTC().Format(time.RFC3339))))
	var invalid *meter.InvalidBatchError
	require.ErrorAs(t, err, &invalid, "a timestamp now where none was given is other content")

	// Stamped events of two months under one id: the second is other
	// content.
	t1, t2 := monthsAgo(1).Add(time.Hour), monthsAgo(2).Add(time.Hour)
	b.MustIngest(t, ev("e2", "acme", "api", 1, &t1))
	_, err = b.Ingest(t, ev("e2", "acme", "api", 1, &t2))
	require.ErrorAs(t, err, &invalid)
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_events WHERE event_id = 'e2'"))
	require.Equal(t, 2, b.countOf(t, "SELECT count(*) FROM usage_events"))
}

// Concurrent posts of one id, in different months (one stamped now, one
// last month) and in one: exactly one row.
func TestConcurrentPostsOfOneIDStoreOneRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	last := monthsAgo(1).Add(time.Hour)
	for round := range 8 {
		id := fmt.Sprintf("c%d", round)
		var wg sync.WaitGroup
		errs := make([]error, 6)
		for i := range errs {
			wg.Go(func() {
				var ts *time.Time
				switch i % 3 {
				case 1:
					ts = &last
				case 2:
					ts = at(time.Now().UTC().Format(time.RFC3339))
				}
				_, errs[i] = b.Ingest(t, ev(id, "acme", "api", 1, ts))
			})
		}
		wg.Wait()
		ok := 0
		for _, err := range errs {
			var invalid *meter.InvalidBatchError
			if err == nil {
				ok++
			} else {
				require.ErrorAs(t, err, &invalid)
			}
		}
		require.NotZero(t, ok)
		require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_events WHERE event_id = $1", id), id)
		require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_event_keys WHERE event_key = md5($1)::uuid", id), id)
	}
}

// Months ahead: a month with no partition yet gets one before its first
// event (the daily job), and the ensuring is idempotent; an event far in
// the past lands in usage_events_before.
func TestMonthsAheadAreCreatedBeforeTheirEvents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	far := monthsAgo(-5)
	_, err := b.Pool.Exec(b.Ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
		VALUES ('acme', 'x', 'api', 1, $1, true, tally_bucket('acme'))`, far)
	require.Error(t, err, "no partition five months ahead yet")

	made, err := meter.EnsureMonths(b.Ctx, b.Pool, 6)
	require.NoError(t, err)
	require.Equal(t, 3, made, "the migration made three months ahead")
	made, err = meter.EnsureMonths(b.Ctx, b.Pool, 6)
	require.NoError(t, err)
	require.Zero(t, made)
	_, err = b.Pool.Exec(b.Ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
		VALUES ('acme', 'x', 'api', 1, $1, true, tally_bucket('acme'))`, far)
	require.NoError(t, err)
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM "+meter.MonthPartition(far)))

	b.MustIngest(t, ev("2001", "acme", "api", 1, at("2001-02-03T04:05:06Z")))
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM usage_events_before"))
	// The month after the next is there from the start: the ingest of the
	// longest future timestamp accepted never lacks a partition.
	require.Equal(t, 1, b.countOf(t, "SELECT count(*) FROM pg_class WHERE relname = $1", meter.MonthPartition(monthsAgo(-3))))
}

// A detach interrupted between the detach and the drop is finished by
// running it again.
func TestDetachMonthResumes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := monthsAgo(3)
	t1 := old.Add(time.Hour)
	b.MustIngest(t, ev("a", "acme", "api", 1, &t1))
	_, err := b.Pool.Exec(b.Ctx, `INSERT INTO usage_closed_months (month, events, closed_by) VALUES ($1::date, 1, 't')`, old)
	require.NoError(t, err)
	_, err = b.Pool.Exec(b.Ctx, "ALTER TABLE usage_events DETACH PARTITION "+meter.MonthPartition(old))
	require.NoError(t, err)
	res, err := meter.DetachMonth(b.Ctx, b.Pool, old, proof(old, 1), "operator")
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Events)
	require.Zero(t, b.countOf(t, "SELECT count(*) FROM pg_class WHERE relname = $1", meter.MonthPartition(old)))
}
