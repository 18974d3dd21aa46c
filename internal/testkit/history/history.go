// Package history is the benchmark fixture of a database with a long
// history: months of staged ledger rows and confirmed outbox items (with
// their attempt log and the gauge's snapshots) under realistic tenants,
// features and hours, loaded by COPY. It lets a benchmark measure Tally's
// routine operations on a loaded database beside an empty one.
//
// It is for tests and benchmarks only. It writes the rows of several
// packages' tables directly, as a restore would, and never on a database
// that is not a test's own.
package history

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// EnvRows names the variable that sets the fixture's ledger rows; the
// confirmed items are a quarter of them. Unset, the fixture has the
// issue's sizes (DefaultRows); a small value (e.g. 200000) makes a quick
// check.
const EnvRows = "TALLY_HISTORY_ROWS"

// DefaultRows is the fixture's ledger rows by default: 20 million, carried
// by 5 million confirmed items.
const DefaultRows = 20_000_000

// EventsPerItem is how many ledger rows each of Load's items carries.
const EventsPerItem = 4

// The fixture's destination: the simulator's account, test mode, v1.
const (
	Exporter = "stripe_meter_events"
	Account  = "acct_sim"
	Mode     = outbox.ModeTest
)

// Tenants and Features of the fixture: every tenant uses every feature, each
// a sum over hourly windows.
var (
	Tenants  = names("org-", 200)
	Features = []string{"api_calls", "compute_seconds", "storage_gb_hours", "messages_sent", "active_seats"}
)

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%04d", prefix, i+1)
	}
	return out
}

// Customer is tenant's Stripe customer: "cus_" and the tenant without its
// dash.
func Customer(tenant string) string { return "cus_org" + tenant[len("org-"):] }

// Size is how much history to load.
type Size struct {
	// Rows is the ledger rows; Items the confirmed items carrying them.
	Rows, Items int64
}

// SizeFrom reads EnvRows through getenv.
func SizeFrom(getenv func(string) string) (Size, error) {
	rows := int64(DefaultRows)
	if v := getenv(EnvRows); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < EventsPerItem*int64(len(Tenants)*len(Features)) {
			return Size{}, fmt.Errorf("%s: a whole number of at least %d, got %q", EnvRows,
				EventsPerItem*len(Tenants)*len(Features), v)
		}
		rows = n
	}
	return Size{Rows: rows - rows%EventsPerItem, Items: rows / EventsPerItem}, nil
}

// Map maps every tenant to its customer and every feature to the meter of
// its own name (sum, hourly), through package mappings.
func Map(ctx context.Context, pool *pgxpool.Pool) error {
	var st mappings.Store
	for _, f := range Features {
		if _, _, err := st.PutFeature(ctx, pool, f, mappings.FeatureInput{EventName: f, Aggregation: mappings.Sum,
			Window: mappings.Duration(time.Hour)}, "history"); err != nil {
			return fmt.Errorf("history: mapping %s: %w", f, err)
		}
	}
	for _, t := range Tenants {
		if _, _, err := st.PutTenant(ctx, pool, t, mappings.TenantInput{StripeCustomerID: Customer(t)}, "history"); err != nil {
			return fmt.Errorf("history: mapping %s: %w", t, err)
		}
	}
	return nil
}

// Loaded is what Load did and what it cost.
type Loaded struct {
	Size Size
	// From and To bound the history's hours; To is before the current
	// month and at least two days before now.
	From, To time.Time
	// Copy is the time of the COPYs, Vacuum that of the VACUUM ANALYZE
	// that follows (a database with history has been vacuumed).
	Copy, Vacuum time.Duration
}

// End is where the history stops, from now: two days ago or the start of
// the month a day ago, whichever is earlier, so that the last day's hours
// (where a benchmark's fresh usage goes) and their month hold no history.
func End(now time.Time) time.Time {
	now = now.UTC()
	end := now.Add(-48 * time.Hour).Truncate(time.Hour)
	day := now.Add(-24 * time.Hour)
	if m := time.Date(day.Year(), day.Month(), 1, 0, 0, 0, 0, time.UTC); m.Before(end) {
		end = m
	}
	return end
}

// Load writes size's history into pool's database, which Map has mapped
// and which has no items yet: the items first (ids from 1), then their
// attempt log, the ledger rows and the gauge's snapshots. Each item is one
// tenant's feature in one hour, the hours running back from End(now) over
// as many months as size needs; each carries EventsPerItem ledger rows.
// The load runs with session_replication_role = replica where the role
// may set it (the test cluster's superuser): the rows are consistent by
// construction, and the foreign keys' per-row checks would only slow it.
func Load(ctx context.Context, pool *pgxpool.Pool, size Size, now time.Time) (Loaded, error) {
	keys := int64(len(Tenants) * len(Features))
	hours := (size.Items + keys - 1) / keys
	l := Loaded{Size: size, To: End(now)}
	l.From = l.To.Add(-time.Duration(hours) * time.Hour)
	return load(ctx, pool, l)
}

// MonthItems is how many items LoadMonth makes of month: one per tenant,
// feature and hour of the month.
func MonthItems(month time.Time) int64 {
	from := time.Date(month.Year(), month.Month(), 1, 0, 0, 0, 0, time.UTC)
	hours := int64(from.AddDate(0, 1, 0).Sub(from) / time.Hour)
	return hours * int64(len(Tenants)*len(Features))
}

// LoadMonth writes one calendar month of history into pool's database, as
// Load does: every tenant's feature in every hour of month is one confirmed
// item, and the month's events (at least one an item) are spread over them
// as evenly as whole rows allow. The month must be over.
func LoadMonth(ctx context.Context, pool *pgxpool.Pool, month time.Time, events int64) (Loaded, error) {
	from := time.Date(month.Year(), month.Month(), 1, 0, 0, 0, 0, time.UTC)
	items := MonthItems(from)
	if events < items {
		return Loaded{}, fmt.Errorf("history: %d events for %d items: at least one an item", events, items)
	}
	if !from.AddDate(0, 1, 0).Before(time.Now()) {
		return Loaded{}, fmt.Errorf("history: %s is not over", from.Format("2006-01"))
	}
	return load(ctx, pool, Loaded{Size: Size{Rows: events, Items: items}, From: from, To: from.AddDate(0, 1, 0)})
}

// load writes l.Size's rows, the hours running from l.From.
func load(ctx context.Context, pool *pgxpool.Pool, l Loaded) (Loaded, error) {
	size := l.Size
	versions, err := versionsOf(ctx, pool)
	if err != nil {
		return l, err
	}
	start := time.Now()
	g := gen{size: size, from: l.From, versions: versions, buckets: make([]int16, len(Tenants))}
	for i, t := range Tenants {
		g.buckets[i] = tenantbucket.Of(t)
	}
	if err := copyIn(ctx, pool, "outbox_item_bodies", bodyColumns, g.bodies()); err != nil {
		return l, err
	}
	// The rest refer to the items, not to one another: two at a time.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	wg.Go(func() { errs[0] = copyIn(ctx, pool, "usage_events", eventColumns, g.events()) })
	wg.Go(func() {
		errs[1] = copyIn(ctx, pool, "outbox_item_states", stateColumns, g.states())
		errs[2] = copyIn(ctx, pool, "outbox_attempts", attemptColumns, g.attempts())
		errs[3] = copyIn(ctx, pool, "outbox_snapshots", []string{"at", "state", "items"}, g.snapshots())
	})
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return l, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return l, fmt.Errorf("history: %w", err)
	}
	defer conn.Release()
	// Sorts of a large load stay in memory longer; the session is this
	// load's own.
	if _, err := conn.Exec(ctx, "SET work_mem = '256MB'"); err != nil {
		return l, fmt.Errorf("history: %w", err)
	}
	defer func() { _, _ = conn.Exec(context.Background(), "RESET work_mem") }()
	// Each ledger row's key, as the ingest writes it, in the key's order:
	// the primary key's index is then written from left to right.
	if _, err := conn.Exec(ctx, `INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
		SELECT id, occurred_at, md5(event_id)::uuid, tenant, bucket FROM usage_events ORDER BY tenant, md5(event_id)::uuid`); err != nil {
		return l, fmt.Errorf("history: the events' keys: %w", err)
	}
	if _, err := conn.Exec(ctx, `SELECT setval(pg_get_serial_sequence('outbox_item_bodies', 'id'), $1)`, size.Items); err != nil {
		return l, fmt.Errorf("history: %w", err)
	}
	// The COPYs ran without the completeness counters' triggers (as
	// replica): the counters are recounted from the rows, as a migration
	// of an existing database does.
	if _, err := conn.Exec(ctx, `SELECT completeness_recount('-infinity', 'infinity')`); err != nil {
		return l, fmt.Errorf("history: counting completeness: %w", err)
	}
	l.Copy = time.Since(start)
	start = time.Now()
	if _, err := conn.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return l, fmt.Errorf("history: vacuum: %w", err)
	}
	l.Vacuum = time.Since(start)
	return l, nil
}

// copyIn copies src into table on a connection of its own.
func copyIn(ctx context.Context, pool *pgxpool.Pool, table string, cols []string, src pgx.CopyFromSource) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("history: %w", err)
	}
	defer conn.Release()
	// Refused to a role that is not a superuser: the load then runs the
	// foreign keys' checks as well.
	if _, err := conn.Exec(ctx, "SET session_replication_role = replica"); err == nil {
		defer func() { _, _ = conn.Exec(context.Background(), "RESET session_replication_role") }()
	}
	if _, err := conn.Conn().CopyFrom(ctx, pgx.Identifier{table}, cols, src); err != nil {
		return fmt.Errorf("history: copying %s: %w", table, err)
	}
	return nil
}

// versionsOf reads the mapping version of every tenant and feature pair,
// by tenant and feature index.
func versionsOf(ctx context.Context, pool *pgxpool.Pool) ([]int, error) {
	var st mappings.Store
	out := make([]int, 0, len(Tenants)*len(Features))
	for _, t := range Tenants {
		for _, f := range Features {
			p, err := st.Lookup(ctx, pool, t, f)
			if err != nil || p.Tenant == nil || p.Feature == nil {
				return nil, fmt.Errorf("history: %s/%s not mapped (run Map first): %v", t, f, err)
			}
			out = append(out, p.Version())
		}
	}
	return out, nil
}

// payloadJSON is an item's payload as the stager writes it.
func payloadJSON(p outbox.Payload) []byte {
	b, _ := json.Marshal(p) // a struct of strings and integers: cannot fail
	return b
}
