package exporter

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Meters by id. Stripe sends a meter event to the one active meter of its
// event name; once that meter is deactivated, the name may move to a new
// meter, and the old one keeps its summaries. The directory (table
// stripe_meters) is Tally's copy of each destination account's meters,
// read from Stripe's meter list (RecordMeters): every accepted item records
// the meter its event name resolved to (ActiveMeter), so that
// reconciliation reads that meter's summaries; and an event name whose
// meters are all deactivated is paused (Paused): claims leave its items
// pending, without an attempt, until a meter of that name is active again.

// MeterRefreshEvery is how long the directory's snapshot serves lookups
// before it is read from the database again: a pause or a resume recorded
// by any node reaches every node's claims within it.
const MeterRefreshEvery = 5 * time.Second

// PausedMeter is an event name of a destination account whose meters are
// all deactivated: its items wait.
type PausedMeter struct {
	Account   string `json:"account"`
	Mode      string `json:"mode"`
	EventName string `json:"event_name"`
	// Meter is the latest deactivated meter of the name, and Since when
	// Tally saw it deactivated.
	Meter string    `json:"meter"`
	Since time.Time `json:"since"`
}

// Explain says, for the console and /readyz, what a paused event name
// means.
func (p PausedMeter) Explain() string {
	return fmt.Sprintf("Meter %s of event name %s is deactivated in %s and no active meter has the name: its items wait pending, without attempts, and export once a meter of the name is active.",
		p.Meter, p.EventName, p.Account)
}

// SkipKey is what a claim leaves alone for p: its account's items of its
// event name (outbox.ClaimOptions.SkipMeters).
func (p PausedMeter) SkipKey() string { return outbox.MeterSkipKey(p.Account, p.EventName) }

// MeterChange is a meter whose status RecordMeters saw change, or saw for
// the first time.
type MeterChange struct {
	Account, Mode, ID, EventName string
	// From is the status before ("" for a meter not seen before); To the
	// status now.
	From, To string
}

// sqlRecordMeter upserts one meter of an account, and says what its status
// was before (NULL: new).
const sqlRecordMeter = `
WITH prev AS (SELECT status FROM stripe_meters WHERE account = @account AND mode = @mode AND id = @id),
up AS (
    INSERT INTO stripe_meters AS m (account, mode, id, event_name, status, formula)
    VALUES (@account, @mode, @id, @event_name, @status, @formula)
    ON CONFLICT (account, mode, id) DO UPDATE SET
        event_name = EXCLUDED.event_name, status = EXCLUDED.status, formula = EXCLUDED.formula,
        seen_at = clock_timestamp(),
        changed_at = CASE WHEN m.status = EXCLUDED.status THEN m.changed_at ELSE clock_timestamp() END
    RETURNING 1
)
SELECT (SELECT status FROM prev) FROM up`

// RecordMeters stores the meters Stripe listed for account in mode (every
// meter of it, active and inactive), in one transaction, and returns the
// meters whose status changed or that were new. A meter missing from the
// list keeps its last known row.
func RecordMeters(ctx context.Context, db pgdb.Beginner, account string, mode stripeapi.Mode, meters []stripeapi.Meter) ([]MeterChange, error) {
	var changes []MeterChange
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		changes = nil
		for _, m := range meters {
			if m.Status != "active" && m.Status != "inactive" {
				continue // a status Tally does not know: keep what was known
			}
			var prev *string
			if err := tx.QueryRow(ctx, sqlRecordMeter, pgx.NamedArgs{"account": account, "mode": string(mode), "id": m.ID,
				"event_name": m.EventName, "status": m.Status, "formula": m.Formula}).Scan(&prev); err != nil {
				return fmt.Errorf("exporter: recording meter %s: %w", m.ID, err)
			}
			if prev == nil || *prev != m.Status {
				c := MeterChange{Account: account, Mode: string(mode), ID: m.ID, EventName: m.EventName, To: m.Status}
				if prev != nil {
					c.From = *prev
				}
				changes = append(changes, c)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return changes, nil
}

// sqlPausedMeters lists the event names of each account and mode that have
// meters, none of them active, with the latest deactivated one.
const sqlPausedMeters = `
SELECT DISTINCT ON (account, mode, event_name) account, mode, event_name, id, changed_at
FROM stripe_meters m
WHERE status = 'inactive'
  AND NOT EXISTS (SELECT FROM stripe_meters a WHERE a.account = m.account AND a.mode = m.mode
                  AND a.event_name = m.event_name AND a.status = 'active')
ORDER BY account, mode, event_name, changed_at DESC, id`

// sqlActiveMeters lists every active meter.
const sqlActiveMeters = `SELECT account, mode, event_name, id FROM stripe_meters WHERE status = 'active'`

// meterKey names an event name of an account in a mode.
type meterKey struct{ account, mode, eventName string }

// meterSnapshot is the directory as read at one moment.
type meterSnapshot struct {
	active map[meterKey]string
	paused []PausedMeter
	at     time.Time
}

// MeterDirectory answers from stripe_meters, through a snapshot at most
// MeterRefreshEvery old. The table has one row per meter of the
// destination accounts: reading it whole is reading a few hundred rows at
// most, whatever the volume of usage. It is safe for concurrent use.
type MeterDirectory struct {
	mu   sync.Mutex
	snap *meterSnapshot
}

// NewMeterDirectory makes an empty directory; its lookups read
// stripe_meters through the Querier they are given.
func NewMeterDirectory() *MeterDirectory { return &MeterDirectory{} }

// Invalidate makes the next lookup read the table again: after this node
// recorded a change.
func (d *MeterDirectory) Invalidate() {
	d.mu.Lock()
	d.snap = nil
	d.mu.Unlock()
}

// snapshot returns a snapshot no older than MeterRefreshEvery, read
// through q when the last one is older.
func (d *MeterDirectory) snapshot(ctx context.Context, q pgdb.Querier) (*meterSnapshot, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.snap != nil && time.Since(d.snap.at) < MeterRefreshEvery {
		return d.snap, nil
	}
	s := &meterSnapshot{active: map[meterKey]string{}, at: time.Now()}
	rows, err := q.Query(ctx, sqlActiveMeters)
	if err != nil {
		return nil, fmt.Errorf("exporter: reading the meters: %w", err)
	}
	var k meterKey
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&k.account, &k.mode, &k.eventName, &id}, func() error {
		s.active[k] = id
		return nil
	}); err != nil {
		return nil, fmt.Errorf("exporter: reading the meters: %w", err)
	}
	rows, err = q.Query(ctx, sqlPausedMeters)
	if err != nil {
		return nil, fmt.Errorf("exporter: reading the paused meters: %w", err)
	}
	if s.paused, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (PausedMeter, error) {
		var p PausedMeter
		err := row.Scan(&p.Account, &p.Mode, &p.EventName, &p.Meter, &p.Since)
		p.Since = p.Since.UTC()
		return p, err
	}); err != nil {
		return nil, fmt.Errorf("exporter: reading the paused meters: %w", err)
	}
	d.snap = s
	return s, nil
}

// ActiveMeter returns the id of the active meter of eventName in account
// and mode; false when the directory knows none.
func (d *MeterDirectory) ActiveMeter(ctx context.Context, q pgdb.Querier, account string, mode outbox.Mode, eventName string) (string, bool, error) {
	s, err := d.snapshot(ctx, q)
	if err != nil {
		return "", false, err
	}
	id, ok := s.active[meterKey{account, string(mode), eventName}]
	return id, ok, nil
}

// Paused lists the event names whose meters are all deactivated, by
// account, mode and event name.
func (d *MeterDirectory) Paused(ctx context.Context, q pgdb.Querier) ([]PausedMeter, error) {
	s, err := d.snapshot(ctx, q)
	if err != nil {
		return nil, err
	}
	return slices.Clone(s.paused), nil
}

// SkipKeys is what claims in mode leave alone: the skip key of every
// paused event name of that mode, sorted.
func (d *MeterDirectory) SkipKeys(ctx context.Context, q pgdb.Querier, mode outbox.Mode) ([]string, error) {
	s, err := d.snapshot(ctx, q)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, p := range s.paused {
		if p.Mode == string(mode) {
			out = append(out, p.SkipKey())
		}
	}
	slices.Sort(out)
	return out, nil
}

// RefreshMeters reads every meter of account from Stripe through client
// (a client acting for that account: the node's own, or Client.For) and
// records them (RecordMeters). A node refreshes each account it exports to
// every hour, and at once when Stripe reports a meter's creation or status
// change.
func RefreshMeters(ctx context.Context, db pgdb.Beginner, client *stripeapi.Client, account string) ([]MeterChange, error) {
	meters, err := client.Meters(ctx)
	if err != nil {
		return nil, err
	}
	return RecordMeters(ctx, db, account, client.Mode(), meters)
}
