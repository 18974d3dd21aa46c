package archive

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type bundle struct {
	*stagetest.Env
	store  *DirStore
	dir    string
	period string
	// start is the first instant of the current month: the archived
	// period is the month before it.
	start time.Time
}

func setup(t *testing.T) *bundle {
	t.Helper()
	e := stagetest.New(t, outbox.Config{})
	dir := t.TempDir()
	s, err := NewDirStore(dir)
	require.NoError(t, err)
	now := time.Now().UTC()
	start := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	return &bundle{Env: e, store: s, dir: dir, start: start, period: start.AddDate(0, -1, 0).Format("2006-01")}
}

func (b *bundle) cfg() Config { return Config{Store: b.store, By: "test"} }

// before is h hours before the current month began: in the archived month.
func (b *bundle) before(h int) *time.Time {
	t := b.start.Add(-time.Duration(h) * time.Hour)
	return &t
}

// settle claims every pending item and answers each: rejected with a
// Stripe 400 when reject says so, else accepted and then confirmed.
func (b *bundle) settle(t *testing.T, reject func(outbox.Lease) bool, confirm bool) {
	t.Helper()
	var accepted []int64
	for {
		leases, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "test", Limit: 100})
		require.NoError(t, err)
		if len(leases) == 0 {
			break
		}
		for _, l := range leases {
			if reject != nil && reject(l) {
				require.NoError(t, b.Outbox.Reject(b.Ctx, b.Pool, l, outbox.ErrorInfo{Code: "stripe_400", Status: 400, Message: "bad"}))
				continue
			}
			require.NoError(t, b.Outbox.Accept(b.Ctx, b.Pool, l, "req_test"))
			accepted = append(accepted, l.ID)
		}
	}
	if confirm && len(accepted) > 0 {
		_, refused, err := b.Outbox.Confirm(b.Ctx, b.Pool, accepted)
		require.NoError(t, err)
		require.Empty(t, refused)
	}
}

func (b *bundle) cancel(t *testing.T, tenant, id string) {
	t.Helper()
	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.Ctx) }()
	_, err = b.Stager.Cancel(b.Ctx, tx, "test", []meter.Cancellation{{Tenant: tenant, ID: id}})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(b.Ctx))
}

// closedMonth fills the archived month with usage every item of which is
// terminal: windowed (sum, last) and per-event (count) features, two
// tenants, an event withdrawn before staging and one after, a rejected
// item, the rest confirmed.
func (b *bundle) closedMonth(t *testing.T) {
	t.Helper()
	b.Feature(t, "calls", mappings.Sum, time.Hour)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.Feature(t, "logins", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", nil)
	b.MustIngest(t,
		stagetest.Ev("c1", "acme", "calls", 5, b.before(5)), stagetest.Ev("c2", "acme", "calls", 7, b.before(5)),
		stagetest.Ev("c3", "beta", "calls", 11, b.before(30)), stagetest.Ev("c4", "acme", "calls", -2, b.before(4)),
		stagetest.Ev("s1", "acme", "seats", 3, b.before(6)), stagetest.Ev("s2", "acme", "seats", 9, b.before(6)),
		stagetest.Ev("l1", "acme", "logins", 1, b.before(7)), stagetest.Ev("l2", "beta", "logins", 1, b.before(7)),
		stagetest.Ev("l3", "beta", "logins", 1, b.before(8)), stagetest.Ev("l4", "acme", "logins", 1, b.before(9)))
	b.cancel(t, "acme", "c4") // withdrawn before it was staged
	b.Pass(t)
	b.cancel(t, "acme", "l4") // its item withdrawn before any attempt
	b.settle(t, func(l outbox.Lease) bool { return strings.HasSuffix(l.SubjectRef, ":l3") }, true)
}

func TestArchiveRefusesAnOpenPeriod(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The current month has not ended.
	_, err := Archive(b.Ctx, b.Pool, b.start.Format("2006-01"), b.cfg())
	var r *Refusal
	require.ErrorAs(t, err, &r)
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "still open")
	require.Contains(t, err.Error(), "tenants without a mapping")

	// A tenant anchored two hours later in the day keeps last month's
	// period open until its own end, two hours from now (but in the last
	// two hours of a month, when that anchor is next month's).
	if soon := time.Now().UTC().Add(2 * time.Hour); soon.Month() == time.Now().UTC().Month() {
		anchor := soon.AddDate(-1, 0, 0)
		b.Tenant(t, "late-anchor", &anchor)
		_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
		require.ErrorAs(t, err, &r)
		require.Contains(t, err.Error(), "late-anchor")
	}

	// The node's invoice grace counts too.
	b2 := setup(t)
	cfg := b2.cfg()
	cfg.InvoiceGrace = time.Since(b2.start) + time.Hour
	_, err = Archive(b2.Ctx, b2.Pool, b2.period, cfg)
	require.ErrorAs(t, err, &r)
	require.Contains(t, err.Error(), "still open")
	requireNoArchive(t, b2)
}

func TestArchiveRefusesItemsNotTerminal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "calls", mappings.Sum, time.Hour)
	b.Feature(t, "ghost-unmapped", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t, stagetest.Ev("c1", "acme", "calls", 5, b.before(5)))

	// Not staged yet.
	_, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "1 event(s) not staged yet")

	// Staged, pending.
	b.Pass(t)
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "1 item(s) pending")

	// Accepted, not confirmed.
	b.settle(t, nil, false)
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "1 item(s) accepted")

	// Quarantined: a usage of a feature that was never mapped.
	b.MustIngest(t, stagetest.Ev("g1", "acme", "ghost", 1, b.before(5)))
	b.Pass(t)
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "1 item(s) quarantined")
	requireNoArchive(t, b)
}

func requireNoArchive(t *testing.T, b *bundle) {
	t.Helper()
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM archives`).Scan(&n))
	require.Zero(t, n)
	entries, err := os.ReadDir(b.dir)
	require.NoError(t, err)
	require.Empty(t, entries, "a refused archive writes no file")
}

func TestArchiveVerifyDetachLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	before, err := quarantine.CompletenessOf(b.Ctx, b.Pool, b.period, "")
	require.NoError(t, err)
	require.True(t, before.Holds)

	// No proof before a verification.
	_, err = Verified(b.Ctx, b.Pool, b.period)
	require.ErrorIs(t, err, ErrNotVerified)

	res, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.NoError(t, err)
	require.Equal(t, 1, res.Manifest.Generation)
	rows := map[string]int64{}
	for _, f := range res.Manifest.Files {
		rows[f.Name] = f.Rows
		require.FileExists(t, filepath.Join(b.dir, b.period, "g0001", f.Name))
	}
	require.EqualValues(t, 10, rows[fileEvents])
	require.EqualValues(t, 2, rows[fileCancellations])
	require.Positive(t, rows[fileBodies])
	require.Equal(t, rows[fileBodies], rows[fileStates])
	require.Positive(t, rows["outbox_attempts.parquet"])
	require.Empty(t, Differences(res.Manifest.Completeness.Lines, before.Lines, "manifest", "database"))

	// Written is not verified.
	_, err = Verified(b.Ctx, b.Pool, b.period)
	require.ErrorIs(t, err, ErrNotVerified)

	v, err := Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.NoError(t, err)
	require.Equal(t, StateVerified, v.State)
	require.True(t, v.ComparedWithDatabase)
	require.EqualValues(t, sum(rows), v.Rows)

	proof, err := Verified(b.Ctx, b.Pool, b.period)
	require.NoError(t, err)
	require.Equal(t, 1, proof.Generation)
	require.Equal(t, res.ManifestSHA256, proof.ManifestSHA256)

	// A verified archive is never written over.
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "generation 1 is verified already")

	// Until the detach, the report is the database's.
	live, archived, err := Completeness(b.Ctx, b.Pool, b.store, b.period)
	require.NoError(t, err)
	require.False(t, archived)
	require.Empty(t, Differences(live.Lines, before.Lines, "live", "database"))

	// The detach's side: marked in its transaction, then the report of
	// the period answers from the manifest.
	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	require.NoError(t, MarkDetached(b.Ctx, tx, proof, "test"))
	require.NoError(t, tx.Commit(b.Ctx))
	c, archived, err := Completeness(b.Ctx, b.Pool, b.store, b.period)
	require.NoError(t, err)
	require.True(t, archived)
	_, archived, err = Completeness(b.Ctx, b.Pool, nil, b.period)
	require.NoError(t, err)
	require.True(t, archived, "from the archives table's copy without the store")
	require.Empty(t, Differences(c.Lines, before.Lines, "archived", "database"))

	// A node's report of the month answers from the manifest, marked.
	reports, err := quarantine.NewReports(0, nil)
	require.NoError(t, err)
	reports.Archived = DetachedReport
	r, err := reports.Completeness(b.Ctx, b.Pool, b.period, "", true)
	require.NoError(t, err)
	require.True(t, r.Archived)
	require.Empty(t, Differences(r.Lines, before.Lines, "report", "database"))
	live, err = reports.Completeness(b.Ctx, b.Pool, b.start.Format("2006-01"), "", true)
	require.NoError(t, err)
	require.False(t, live.Archived, "a month still in the database answers from its counters")

	// A detached archive verifies against its manifest alone.
	v, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.NoError(t, err)
	require.False(t, v.ComparedWithDatabase)
	require.Equal(t, StateDetached, v.State)

	trail, err := audit.List(b.Ctx, b.Pool, Subject(b.period), 10)
	require.NoError(t, err)
	var actions []string
	for _, e := range trail {
		actions = append(actions, e.Action+":"+e.To)
	}
	require.Equal(t, []string{"archive.verify:detached", "archive.detach:detached", "archive.verify:verified", "archive.write:written"}, actions)
}

func sum(m map[string]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// TestVerifyFailsOnCorruption: every kind of damage fails verify with the
// file named, and the generation stays unverified (no proof for detach).
func TestVerifyFailsOnCorruption(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		damage  func(t *testing.T, dir string)
		message string
	}{
		{"a byte flipped", func(t *testing.T, dir string) {
			p := filepath.Join(dir, fileEvents)
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			b[len(b)/2] ^= 0x01
			require.NoError(t, os.WriteFile(p, b, 0o640))
		}, fileEvents + ": sha256"},
		{"a file missing", func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, fileStates)))
		}, fileStates + ": missing"},
		{"a row count changed in the manifest", func(t *testing.T, dir string) {
			p := filepath.Join(dir, manifestName)
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			s := strings.Replace(string(b), `"rows": 10,`, `"rows": 11,`, 1)
			require.NotEqual(t, string(b), s)
			require.NoError(t, os.WriteFile(p, []byte(s), 0o640))
		}, manifestName + ": sha256"},
		{"a file replaced by another with fewer rows", func(t *testing.T, dir string) {
			// The cancellations file swapped for the (empty) evidence
			// file: a readable Parquet file of the wrong rows.
			b, err := os.ReadFile(filepath.Join(dir, "meter_error_evidence.parquet"))
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(dir, fileCancellations), b, 0o640))
		}, fileCancellations + ": "},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.closedMonth(t)
			_, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
			require.NoError(t, err)
			tc.damage(t, filepath.Join(b.dir, b.period, "g0001"))

			_, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
			require.ErrorIs(t, err, ErrVerifyFailed)
			require.Contains(t, err.Error(), tc.message)
			_, err = Verified(b.Ctx, b.Pool, b.period)
			require.ErrorIs(t, err, ErrNotVerified, "a failed verification leaves the archive unverified")
			trail, err := audit.List(b.Ctx, b.Pool, Subject(b.period), 1)
			require.NoError(t, err)
			require.Equal(t, "failed", trail[0].To)
		})
	}
}

// TestVerifyComparesWithTheDatabase: usage staged into the period after
// it was archived (late usage) makes the database differ from the
// manifest, and verify says so.
func TestVerifyComparesWithTheDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	_, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.NoError(t, err)
	b.MustIngest(t, stagetest.Ev("c9", "acme", "calls", 4, b.before(3)))
	b.Pass(t)
	_, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.ErrorIs(t, err, ErrVerifyFailed)
	require.Contains(t, err.Error(), "(manifest vs database)")
	require.Contains(t, err.Error(), fileEvents+": the manifest says 10 rows, the database holds 11")
}

// TestRecomputeEqualsDatabase: the totals recomputed in Go from the
// archived rows equal the report's query on a varied month: per-event and
// windowed features, a superseded chain, cancellations, and items
// quarantined, rejected, accepted, pending and sent late.
func TestRecomputeEqualsDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	b.Feature(t, "minutes", mappings.Sum, 15*time.Minute)
	// gamma has no mapping yet: quarantined no_customer, then re-addressed.
	b.MustIngest(t, stagetest.Ev("g1", "gamma", "calls", 8, b.before(10)), stagetest.Ev("g2", "gamma", "calls", 2, b.before(10)),
		stagetest.Ev("u1", "acme", "unmapped", 3, b.before(10)),
		stagetest.Ev("m1", "acme", "minutes", 6, b.before(11)), stagetest.Ev("m2", "beta", "minutes", 6, b.before(12)),
		stagetest.Ev("l9", "beta", "logins", 1, b.before(13)))
	b.Pass(t)
	tn := b.Tenant(t, "gamma", nil)
	var old int64
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT item_id FROM usage_events WHERE tenant = 'gamma' AND event_id = 'g1'`).Scan(&old))
	rq := &quarantine.Requeuer{Outbox: b.Outbox, Stager: b.Stager}
	res, err := rq.Requeue(b.Ctx, b.Pool, old, tn.Version, "test")
	require.NoError(t, err)
	require.NotNil(t, res.Successor)
	b.settle(t, func(l outbox.Lease) bool { return strings.HasSuffix(l.SubjectRef, ":l9") }, false)
	// Late usage, staged after the month closed: quarantined period_closed.
	b.Target.InvoiceGrace, b.Target.LateUsage = 0, meter.LateQuarantine
	b.MustIngest(t, stagetest.Ev("c8", "beta", "calls", 5, b.before(2)), stagetest.Ev("m3", "acme", "minutes", 1, b.before(2)))
	b.Pass(t)

	db, err := quarantine.CompletenessOf(b.Ctx, b.Pool, b.period, "")
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, l := range db.Lines {
		for name, x := range map[string]quarantine.Bucket{"confirmed": l.Confirmed, "accepted": l.Accepted, "quarantined": l.Quarantined,
			"rejected": l.Rejected, "cancelled": l.Cancelled, "period_closed": l.PeriodClosed} {
			if x.Events > 0 {
				seen[name] = true
			}
		}
	}
	require.Len(t, seen, 6, "the month is varied: %v", seen)

	from, to, err := quarantine.ParsePeriod(b.period)
	require.NoError(t, err)
	rec := writeSnapshot(t, b, from, to)
	lines, err := recomputeFromStore(b.Ctx, b.store, rec, from, to)
	require.NoError(t, err)
	require.Empty(t, Differences(lines, db.Lines, "files", "database"))
	require.Len(t, lines, len(db.Lines))
}

// writeSnapshot writes the period's files as Archive does, without its
// refusals, and returns the record that names them.
func writeSnapshot(t *testing.T, b *bundle, from, to time.Time) *Record {
	t.Helper()
	tx, err := b.Pool.BeginTx(b.Ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	args := pgx.NamedArgs{"from": from, "to": to}
	for _, s := range sqlItems {
		_, err := tx.Exec(b.Ctx, s, args)
		require.NoError(t, err)
	}
	_, err = writeFiles(b.Ctx, tx, b.store, prefix(b.period, 1), args)
	require.NoError(t, err)
	return &Record{Period: b.period, Generation: 1}
}

// TestArchiveRefusesOpenDiscrepancies: a discrepancy no one resolved that
// involves the month's usage keeps it in the database.
func TestArchiveRefusesOpenDiscrepancies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	var item int64
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT item_id FROM usage_events WHERE event_id = 'c1'`).Scan(&item))
	_, err := b.Pool.Exec(b.Ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle) VALUES ('succeeded', 'command', 'test', '0')`)
	require.NoError(t, err)
	_, err = b.Pool.Exec(b.Ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter,
		customer, hour, formula, expected, provider, difference, expected_items, uncertain_items, explained_by, explanation)
		VALUES (1, 'acct_1', 'test', 'calls', 'mtr_1', 'cus_acme', $1, 'sum', 12, 15, 3, ARRAY[$2::bigint], '{}', '{}', 'unexplained')`,
		b.before(5).Truncate(time.Hour), item)
	require.NoError(t, err)
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "1 open discrepancy hour(s)")
	requireNoArchive(t, b)
}

// TestGenerationsAreNeverWrittenOver: a new generation beside a verified
// one leaves the old files as they were and needs its own verification;
// files a crash left behind are skipped; nothing is written beside a
// detached generation.
func TestGenerationsAreNeverWrittenOver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	// A crash left generation 1's first file, and no row.
	require.NoError(t, os.MkdirAll(filepath.Join(b.dir, b.period, "g0001"), 0o750))
	require.NoError(t, os.WriteFile(filepath.Join(b.dir, b.period, "g0001", fileEvents), []byte("partial"), 0o640))
	first, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.NoError(t, err)
	require.Equal(t, 2, first.Manifest.Generation)
	_, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.NoError(t, err)
	before, err := os.ReadFile(filepath.Join(b.dir, b.period, "g0002", manifestName))
	require.NoError(t, err)

	cfg := b.cfg()
	cfg.NewGeneration = true
	second, err := Archive(b.Ctx, b.Pool, b.period, cfg)
	require.NoError(t, err)
	require.Equal(t, 3, second.Manifest.Generation)
	after, err := os.ReadFile(filepath.Join(b.dir, b.period, "g0002", manifestName))
	require.NoError(t, err)
	require.Equal(t, before, after)
	_, err = Verified(b.Ctx, b.Pool, b.period)
	require.ErrorIs(t, err, ErrNotVerified, "the latest generation is not verified yet")
	_, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.NoError(t, err)
	proof, err := Verified(b.Ctx, b.Pool, b.period)
	require.NoError(t, err)
	require.Equal(t, 3, proof.Generation)

	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	require.NoError(t, MarkDetached(b.Ctx, tx, proof, "test"))
	require.NoError(t, tx.Commit(b.Ctx))
	_, err = Archive(b.Ctx, b.Pool, b.period, cfg)
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "generation 3 is detached")

	// The table refuses what the package never does.
	_, err = b.Pool.Exec(b.Ctx, `DELETE FROM archives`)
	require.ErrorContains(t, err, "rows are never deleted")
	_, err = b.Pool.Exec(b.Ctx, `UPDATE archives SET state = 'written' WHERE generation = 3`)
	require.ErrorContains(t, err, "only moves written -> verified -> detached")
	_, err = b.Pool.Exec(b.Ctx, `UPDATE archives SET manifest_sha256 = repeat('0', 64) WHERE generation = 2`)
	require.ErrorContains(t, err, "a manifest is immutable")
}

// TestArchiveRefusesWhileAnotherRuns: one archive, verify or detach of a
// month at a time.
func TestArchiveRefusesWhileAnotherRuns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	conn, err := b.Pool.Acquire(b.Ctx)
	require.NoError(t, err)
	defer conn.Release()
	unlock, err := lockPeriod(b.Ctx, conn.Conn(), b.period)
	require.NoError(t, err)
	_, err = Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	require.Contains(t, err.Error(), "another archive, verify or detach of this period is running")
	_, err = Verify(b.Ctx, b.Pool, b.period, 0, b.cfg())
	require.ErrorIs(t, err, ErrRefused)
	// Nor a detach of the month, or of the month after (which holds this
	// period's later events).
	for _, p := range []string{b.period, b.start.Format("2006-01")} {
		_, err = Detach(b.Ctx, b.Pool, p, "test")
		require.ErrorIs(t, err, ErrRefused, p)
	}
	unlock()
	requireNoArchive(t, b)
}

// TestRestoreIntoASchemaOfItsOwn: a month's archive loads into a new
// schema, row for row, value for value; a damaged file or a schema that
// exists is refused and leaves nothing.
func TestRestoreIntoASchemaOfItsOwn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.closedMonth(t)
	_, err := Archive(b.Ctx, b.Pool, b.period, b.cfg())
	require.NoError(t, err)

	_, err = Restore(b.Ctx, b.Pool, b.store, b.period, 0, "public")
	require.ErrorContains(t, err, "want a new schema of its own")

	res, err := Restore(b.Ctx, b.Pool, b.store, b.period, 0, "audit_month")
	require.NoError(t, err)
	require.EqualValues(t, 10, res.Rows["usage_events"])
	for _, q := range []string{
		`SELECT count(*), sum(value), max(occurred_at)::text, max(cancelled_at)::text FROM %s.usage_events`,
		`SELECT count(*), sum(mapping_version), max(identifier), max(payload::text) FROM %s.outbox_item_bodies`,
		`SELECT count(*), sum(attempts), max(state), max(last_error_code) FROM %s.outbox_item_states`,
		`SELECT count(*), sum(lease_token), max(outcome), max(recorded_at)::text FROM %s.outbox_attempts`,
	} {
		var restored, live [4]any
		require.NoError(t, b.Pool.QueryRow(b.Ctx, fmt.Sprintf(q, "audit_month")).Scan(&restored[0], &restored[1], &restored[2], &restored[3]))
		require.NoError(t, b.Pool.QueryRow(b.Ctx, fmt.Sprintf(q, "public")).Scan(&live[0], &live[1], &live[2], &live[3]))
		require.Equal(t, live, restored, q)
	}

	_, err = Restore(b.Ctx, b.Pool, b.store, b.period, 0, "audit_month")
	require.ErrorContains(t, err, "already exists")

	p := filepath.Join(b.dir, b.period, "g0001", fileBodies)
	body, err := os.ReadFile(p)
	require.NoError(t, err)
	body[len(body)/3] ^= 0x80
	require.NoError(t, os.WriteFile(p, body, 0o640))
	_, err = Restore(b.Ctx, b.Pool, b.store, b.period, 0, "audit_damaged")
	require.ErrorContains(t, err, fileBodies+": sha256")
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = 'audit_damaged'`).Scan(&n))
	require.Zero(t, n)
}
