package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Defaults of the listing of Stripe's events.
const (
	// DefaultBackfillInterval is how often the listing runs.
	DefaultBackfillInterval = time.Hour
	// listOverlap is how far before the newest report it saw a listing
	// looks again: an event created just before the previous listing may
	// have been listable only after it. Events seen twice are recorded once.
	listOverlap = time.Hour
	// listPageSize is the page size a filtered listing asks for.
	listPageSize = 100
	// backfillTimeout bounds one listing of every account, below the
	// interval.
	backfillTimeout = 50 * time.Minute
	// refetchBatch bounds the unreadable events one listing of an account
	// reads again.
	refetchBatch = 500
)

// BackfillConfig builds a Backfill.
type BackfillConfig struct {
	// Events records what the listing finds.
	Events *Events
	// Key, APIBase and Account are the Stripe settings (STRIPE_API_KEY,
	// STRIPE_API_BASE, STRIPE_ACCOUNT).
	Key, APIBase, Account string
	// Destination is where this node exports: its account is listed.
	Destination func() (exporter.Destination, error)
	// Connected lists the connected accounts tenant mappings have named
	// (mappings.Accounts): each is listed in its context.
	Connected func(ctx context.Context, q pgdb.Querier) ([]string, error)
	// Limiter paces every call of the listing: the Reads class of the
	// destination's budget, reconciliation's.
	Limiter *exporter.Limiter
	Logger  *slog.Logger
	// Metrics counts the listing's Stripe calls; optional.
	Metrics *stripeapi.RequestMetrics
	// Registry takes the listing's series; optional.
	Registry prometheus.Registerer
	// RetryInitial and RetryMax shape the backoff of a call that failed
	// transiently (429, 5xx, no answer), as Config's. Default 500ms and 2
	// minutes.
	RetryInitial, RetryMax time.Duration
	// Meters, when set, is refreshed with each account's meters at every
	// listing (exporter.RefreshMeters): which meter each event name
	// resolves to, and which names are paused.
	Meters *exporter.MeterDirectory
	// MetersOnly reads the meters and lists no events: a restricted key
	// (rk_) may read meters, but Stripe's v2 API, which lists events,
	// takes only secret keys.
	MetersOnly bool
}

// Backfill lists Stripe's error reports (GET /v2/core/events) of every
// account Tally exports to and records those not yet recorded, through
// Events as the event destination's are: the reports the destination
// missed — while Tally's endpoint was down for all of Stripe's retries, or
// for an account whose events are not delivered at all — still reach
// their items. It also reads again the events recorded as unreadable,
// while Stripe keeps them.
//
// Each (account, mode) keeps a cursor in the database: the created time of
// the newest report seen, or an hour before the previous successful
// listing ended if later. A listing goes back to an hour before it, never
// more than 30 days (Stripe keeps events 30 days), and stops paging after
// the first page wholly before it, Stripe listing v2 events newest first.
// It asks Stripe for the report
// types and that time (types[], created[gt]) and filters by both itself
// too; if Stripe refuses the filters (400) it lists without them, and if
// it refuses that too, it lists each of the account's meters' events
// (object_id), as Stripe's earlier references required — which misses
// no_meter_found reports, which relate no meter. Every call is paced with
// reconciliation's reads.
type Backfill struct {
	cfg     BackfillConfig
	client  *stripeapi.Client
	metrics *backfillMetrics
}

type backfillMetrics struct {
	listings *prometheus.CounterVec
}

// NewBackfill validates cfg and builds the listing; it makes no call.
// Without a key it is nil and no error: there is nothing to list.
func NewBackfill(cfg BackfillConfig) (*Backfill, error) {
	if cfg.Key == "" {
		return nil, nil
	}
	if cfg.Events == nil || cfg.Destination == nil || cfg.Connected == nil || cfg.Limiter == nil {
		return nil, errors.New("reconcile: Events, Destination, Connected and Limiter are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RetryInitial <= 0 {
		cfg.RetryInitial = 500 * time.Millisecond
	}
	if cfg.RetryMax <= 0 {
		cfg.RetryMax = 2 * time.Minute
	}
	c, err := stripeapi.New(stripeapi.Config{Key: cfg.Key, APIBase: cfg.APIBase, Account: cfg.Account, Metrics: cfg.Metrics,
		BeforeRequest: cfg.Limiter.Wait})
	if err != nil {
		return nil, err
	}
	m := &backfillMetrics{listings: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_stripe_event_listings_total",
		Help: "Listings of one account's Stripe events (GET /v2/core/events) this node ran, by result: succeeded or failed. When the last one succeeded, any node: tally_job_last_success_age_seconds{task=\"reports\"}.",
	}, []string{"result"})}
	m.listings.WithLabelValues("succeeded")
	m.listings.WithLabelValues("failed")
	if cfg.Registry != nil {
		if err := cfg.Registry.Register(m.listings); err != nil {
			return nil, err
		}
	}
	return &Backfill{cfg: cfg, client: c, metrics: m}, nil
}

// BackfillResult says what one listing of every account did.
type BackfillResult struct {
	// Accounts counts the accounts listed; Failed names those whose
	// listing failed (each is tried again at the next listing).
	Accounts int      `json:"accounts"`
	Failed   []string `json:"failed,omitempty"`
	// Listed counts the report events seen; Recorded those recorded now
	// (the event destination had not delivered them, or they were
	// unreadable until now); Unreadable those Stripe still refused.
	Listed     int `json:"listed"`
	Recorded   int `json:"recorded"`
	Unreadable int `json:"unreadable"`
}

// Run lists the events of every account Tally exports to — the
// destination, then the connected accounts tenant mappings name — and
// records what is not recorded yet. An account whose listing fails is
// recorded as failed and the others are listed; the error is for the
// database, or for a run that could not start (no destination yet).
func (b *Backfill) Run(ctx context.Context, db pgdb.DB) (BackfillResult, error) {
	var res BackfillResult
	dest, err := b.cfg.Destination()
	if err != nil {
		return res, fmt.Errorf("reconcile: listing Stripe's events: %w", err)
	}
	type target struct {
		account, context string
	}
	var targets []target
	if dest.Account != "" {
		// The key's own account is listed as every call is made; a
		// destination named by STRIPE_ACCOUNT is another account, listed
		// in its context.
		t := target{account: dest.Account}
		if b.cfg.Account != "" {
			t.context = dest.Account
		}
		targets = append(targets, t)
	}
	connected, err := b.cfg.Connected(ctx, db)
	if err != nil {
		return res, fmt.Errorf("reconcile: reading the connected accounts: %w", err)
	}
	for _, a := range connected {
		if a != dest.Account {
			targets = append(targets, target{account: a, context: a})
		}
	}
	for _, t := range targets {
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		res.Accounts++
		if err := b.refreshMeters(ctx, db, t.account, t.context); err != nil {
			return res, err
		}
		if b.cfg.MetersOnly {
			continue
		}
		n, err := b.listAccount(ctx, db, t.account, t.context, dest.Mode)
		res.Listed, res.Recorded, res.Unreadable = res.Listed+n.listed, res.Recorded+n.recorded, res.Unreadable+n.unreadable
		if err == nil {
			b.metrics.listings.WithLabelValues("succeeded").Inc()
			continue
		}
		var fail *listingError
		if !errors.As(err, &fail) {
			return res, err
		}
		b.metrics.listings.WithLabelValues("failed").Inc()
		res.Failed = append(res.Failed, t.account)
		b.cfg.Logger.WarnContext(ctx, "listing an account's Stripe events failed; the next listing tries again",
			"account", t.account, "code", fail.info.Code, "status", fail.info.Status)
		if err := recordListingFailure(ctx, db, t.account, dest.Mode, fail.info); err != nil {
			return res, err
		}
	}
	return res, nil
}

// refreshMeters reads account's meters (in stripeContext: "" as every
// call of the node) into the directory, when there is one. A read Stripe
// fails is logged and the directory keeps what it knew: the next listing
// reads again. The error is the database's.
func (b *Backfill) refreshMeters(ctx context.Context, db pgdb.DB, account, stripeContext string) error {
	err := b.readMeters(ctx, db, account, stripeContext)
	var fail *listingError
	if errors.As(err, &fail) {
		b.cfg.Logger.WarnContext(ctx, "reading an account's meters failed; the directory keeps what it knew",
			"account", account, "code", fail.info.Code, "status", fail.info.Status)
		return nil
	}
	return err
}

// readMeters reads account's meters into the directory; a *listingError
// is Stripe's failure, any other the database's.
func (b *Backfill) readMeters(ctx context.Context, db pgdb.DB, account, stripeContext string) error {
	if b.cfg.Meters == nil {
		return nil
	}
	client := b.client
	if stripeContext != "" {
		var err error
		if client, err = b.client.For(account); err != nil {
			return err
		}
	}
	var meters []stripeapi.Meter
	if err := b.read(ctx, func() (err error) { meters, err = client.Meters(ctx); return err }); err != nil {
		return b.failure(err)
	}
	changes, err := exporter.RecordMeters(ctx, db, account, client.Mode(), meters)
	if err != nil {
		return err
	}
	logMeterChanges(ctx, b.cfg.Logger, changes)
	b.cfg.Meters.Invalidate()
	return nil
}

// meterEventTimeout bounds the read of an account's meters that a
// billing.meter.* event asks for.
const meterEventTimeout = 10 * time.Second

// ErrMetersUnread is a read of an account's meters that Stripe failed:
// the event that asked for it should be delivered again.
var ErrMetersUnread = errors.New("reconcile: Stripe did not answer the read of the account's meters")

// MetersChanged reads at once the meters of the account a billing.meter.*
// event is about (account "": the key's own, the node's destination) into
// the directory, when Tally exports to it: a deactivation pauses its event
// name's claims, a new or reactivated meter resumes them, on every node
// within exporter.MeterRefreshEvery. It reports whether Tally exports to
// the account; a read Stripe fails is ErrMetersUnread.
func (b *Backfill) MetersChanged(ctx context.Context, db pgdb.DB, account string) (bool, error) {
	// The read answers Stripe's delivery: it must end well before Stripe
	// gives up on it, retries included (the hourly read is the backstop).
	ctx, cancel := context.WithTimeout(ctx, meterEventTimeout)
	defer cancel()
	dest, err := b.cfg.Destination()
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrMetersUnread, err)
	}
	stripeContext := account
	switch {
	case account == "" || (account == dest.Account && b.cfg.Account == ""):
		account, stripeContext = dest.Account, ""
	case account != dest.Account:
		connected, err := b.cfg.Connected(ctx, db)
		if err != nil {
			return false, fmt.Errorf("reconcile: reading the connected accounts: %w", err)
		}
		if !slices.Contains(connected, account) {
			return false, nil
		}
	}
	err = b.readMeters(ctx, db, account, stripeContext)
	var fail *listingError
	switch {
	case errors.As(err, &fail):
		return true, fmt.Errorf("%w (%s)", ErrMetersUnread, fail.info.String())
	case errors.Is(err, context.DeadlineExceeded) && errors.Is(ctx.Err(), context.DeadlineExceeded):
		return true, fmt.Errorf("%w (no answer within %s)", ErrMetersUnread, meterEventTimeout)
	}
	return true, err
}

// logMeterChanges says which meters changed status since Tally last read
// them: a deactivation pauses its event name's items, a new or reactivated
// meter resumes them.
func logMeterChanges(ctx context.Context, logger *slog.Logger, changes []exporter.MeterChange) {
	for _, c := range changes {
		if c.From == "" && c.To == "active" {
			continue // a meter seen for the first time, as expected
		}
		logger.InfoContext(ctx, "a Stripe meter's status changed", "account", c.Account, "mode", c.Mode, "meter", c.ID,
			"event_name", c.EventName, "from", c.From, "to", c.To)
	}
}

// listingError is Stripe's failure of one account's listing, content-free.
type listingError struct{ info outbox.ErrorInfo }

func (e *listingError) Error() string {
	return "reconcile: listing Stripe's events failed: " + e.info.String()
}

// listed is what listing one account did.
type listed struct {
	listed, recorded, unreadable int
}

// listAccount lists account's events of mode in stripeContext ("": as
// every call of the node) back to its cursor, records what is new, reads
// the unreadable ones again, and moves the cursor.
func (b *Backfill) listAccount(ctx context.Context, db pgdb.DB, account, stripeContext string, mode outbox.Mode) (listed, error) {
	var n listed
	since, err := listingSince(ctx, db, account, mode)
	if err != nil {
		return n, err
	}
	newest := time.Time{}
	seen := func(ev stripeapi.Event) error {
		if !Records(ev.Type) || !ev.Created.After(since) || ev.Livemode != (mode == outbox.ModeLive) {
			return nil
		}
		if ev.Context != "" && stripeapi.ContextAccount(ev.Context) != account {
			// Another account's, were Stripe to list it here: that
			// account's own listing records it, if Tally exports to it.
			return nil
		}
		n.listed++
		if ev.Created.After(newest) {
			newest = ev.Created
		}
		status, err := eventStatus(ctx, db, ev.ID)
		if err != nil || status == statusRecorded {
			return err
		}
		var r Receipt
		if len(ev.Data) == 0 {
			// Listed without its data: read it, in the listing's context.
			if ev.Context == "" {
				ev.Context = stripeContext
			}
			r, err = b.cfg.Events.Receive(ctx, db, ev, b.fetch, ArrivalListing)
		} else {
			r, err = b.cfg.Events.Record(ctx, db, ev, account, ArrivalListing)
		}
		n.count(r)
		var ue *UnavailableError
		if errors.As(err, &ue) {
			return &listingError{outbox.ErrorInfo{Code: ue.Code, Status: ue.Status}}
		}
		return err
	}
	if err := b.list(ctx, account, stripeContext, since, seen); err != nil {
		return n, err
	}
	if err := b.refetch(ctx, db, account, stripeContext, mode, &n); err != nil {
		return n, err
	}
	return n, recordListing(ctx, db, account, mode, newest)
}

func (n *listed) count(r Receipt) {
	switch r.Status {
	case ReceiptRecorded:
		n.recorded++
	case ReceiptUnreadable:
		n.unreadable++
	}
}

// list calls seen with every event of account listed back to since, newest
// first, asking Stripe to filter by type and time, and without the filters
// — or per meter — when Stripe refuses them.
func (b *Backfill) list(ctx context.Context, account, stripeContext string, since time.Time, seen func(stripeapi.Event) error) error {
	filtered := stripeapi.EventList{Types: EventTypes(), CreatedAfter: since, Limit: listPageSize}
	err := b.pages(ctx, stripeContext, filtered, since, seen)
	if !refused(err) {
		return err
	}
	b.cfg.Logger.InfoContext(ctx, "Stripe refused the filters of a listing of events; listing without them", "account", account)
	err = b.pages(ctx, stripeContext, stripeapi.EventList{}, since, seen)
	if !refused(err) {
		return err
	}
	b.cfg.Logger.InfoContext(ctx, "Stripe refused a listing of events without an object; listing each meter's (no_meter_found reports are not found so)",
		"account", account)
	client, err := b.client.For(account)
	if err != nil {
		return err
	}
	var meters []stripeapi.Meter
	if err := b.read(ctx, func() (err error) { meters, err = client.Meters(ctx); return err }); err != nil {
		return b.failure(err)
	}
	for _, m := range meters {
		if err := b.pages(ctx, stripeContext, stripeapi.EventList{ObjectID: m.ID}, since, seen); err != nil {
			return err
		}
	}
	return nil
}

// refused reports whether err is Stripe refusing a listing's parameters.
func refused(err error) bool {
	var fail *listingError
	return errors.As(err, &fail) && fail.info.Status == http.StatusBadRequest
}

// pages lists q's pages, calling seen with each event created after since,
// until a page holds none (the pages are newest first, so the ones after
// it are older still) or there is no page left. A page that reaches back
// past since is not the last one read: were Stripe's order not strictly
// newest first, the next page could still hold a newer event, and the
// cost is one page.
func (b *Backfill) pages(ctx context.Context, stripeContext string, q stripeapi.EventList, since time.Time, seen func(stripeapi.Event) error) error {
	next := ""
	for {
		var page stripeapi.EventPage
		if err := b.read(ctx, func() (err error) { page, err = b.client.ListEvents(ctx, stripeContext, q, next); return err }); err != nil {
			return b.failure(err)
		}
		newer := false
		for _, ev := range page.Events {
			if !ev.Created.After(since) {
				continue
			}
			newer = true
			if err := seen(ev); err != nil {
				return err
			}
		}
		if !newer || page.Next == "" {
			return nil
		}
		next = page.Next
	}
}

// read runs one call of the listing, retried while it fails transiently.
func (b *Backfill) read(ctx context.Context, f func() error) error {
	return retryRead(ctx, b.cfg.Limiter, b.cfg.Logger, b.cfg.RetryInitial, b.cfg.RetryMax, f)
}

// failure is err, the end of a call of the listing, as a listingError
// unless the run was cancelled.
func (b *Backfill) failure(err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	code, status, _ := stripeapi.Describe(err)
	return &listingError{outbox.ErrorInfo{Code: code, Status: status}.Sanitized()}
}

// fetch reads an event with the listing's client, paced as its other calls.
func (b *Backfill) fetch(ctx context.Context, id, stripeContext string) (stripeapi.Event, error) {
	var ev stripeapi.Event
	err := b.read(ctx, func() (err error) { ev, err = b.client.Event(ctx, id, stripeContext); return err })
	return ev, err
}

// sqlUnreadable are the events of an account (NULL: the destination, when
// it was not known) recorded as unreadable that Stripe still keeps, oldest
// first.
const sqlUnreadable = `
SELECT id, type, livemode, created, coalesce(context, '')
FROM stripe_events
WHERE status = 'unreadable' AND created > clock_timestamp() - make_interval(secs => @retention)
  AND livemode = @livemode AND (account = @account OR (account IS NULL AND @own))
ORDER BY created
LIMIT @limit`

// refetch reads account's unreadable events again.
func (b *Backfill) refetch(ctx context.Context, db pgdb.DB, account, stripeContext string, mode outbox.Mode, n *listed) error {
	rows, err := db.Query(ctx, sqlUnreadable, pgx.NamedArgs{"retention": stripeapi.EventRetention.Seconds(),
		"livemode": mode == outbox.ModeLive, "account": account, "own": stripeContext == "", "limit": refetchBatch})
	if err != nil {
		return fmt.Errorf("reconcile: reading the unreadable events: %w", err)
	}
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (stripeapi.Event, error) {
		var ev stripeapi.Event
		err := row.Scan(&ev.ID, &ev.Type, &ev.Livemode, &ev.Created, &ev.Context)
		return ev, err
	})
	if err != nil {
		return fmt.Errorf("reconcile: reading the unreadable events: %w", err)
	}
	for _, ev := range events {
		if ev.Context == "" {
			ev.Context = stripeContext
		}
		r, err := b.cfg.Events.Receive(ctx, db, ev, b.fetch, ArrivalListing)
		var ue *UnavailableError
		if errors.As(err, &ue) {
			return &listingError{outbox.ErrorInfo{Code: ue.Code, Status: ue.Status}}
		}
		if err != nil {
			return err
		}
		n.count(r)
	}
	return nil
}

// listingSince is where account's listing of mode resumes: an hour before
// the newest report it saw, never more than Stripe's 30 days back, by the
// database's clock.
func listingSince(ctx context.Context, q pgdb.Querier, account string, mode outbox.Mode) (time.Time, error) {
	var since time.Time
	err := q.QueryRow(ctx, `SELECT greatest(
		    (SELECT last_created FROM stripe_event_listings WHERE account = $1 AND mode = $2) - make_interval(secs => $3),
		    clock_timestamp() - make_interval(secs => $4))`,
		account, string(mode), listOverlap.Seconds(), stripeapi.EventRetention.Seconds()).Scan(&since)
	if err != nil {
		return time.Time{}, fmt.Errorf("reconcile: reading the events listing of %s: %w", account, err)
	}
	return since, nil
}

// recordListing records a listing of account that succeeded, and moves its
// cursor, never back: to newest (zero: it saw no report), or to an hour
// before the previous successful listing ended, whichever is later — an
// account without reports is not listed 30 days back every time.
func recordListing(ctx context.Context, q pgdb.Querier, account string, mode outbox.Mode, newest time.Time) error {
	var last *time.Time
	if !newest.IsZero() {
		last = &newest
	}
	_, err := q.Exec(ctx, `INSERT INTO stripe_event_listings (account, mode, last_created, listed_at)
		VALUES ($1, $2, $3, clock_timestamp())
		ON CONFLICT (account, mode) DO UPDATE SET
		    last_created = greatest(stripe_event_listings.last_created, EXCLUDED.last_created,
		                            stripe_event_listings.listed_at - make_interval(secs => $4)),
		    listed_at = clock_timestamp(), failed_at = NULL, fail_code = NULL, fail_status = NULL`,
		account, string(mode), last, listOverlap.Seconds())
	if err != nil {
		return fmt.Errorf("reconcile: recording the events listing of %s: %w", account, err)
	}
	return nil
}

// recordListingFailure records how a listing of account failed; its cursor
// stays.
func recordListingFailure(ctx context.Context, q pgdb.Querier, account string, mode outbox.Mode, info outbox.ErrorInfo) error {
	_, err := q.Exec(ctx, `INSERT INTO stripe_event_listings (account, mode, failed_at, fail_code, fail_status)
		VALUES ($1, $2, clock_timestamp(), $3, nullif($4, 0))
		ON CONFLICT (account, mode) DO UPDATE SET failed_at = clock_timestamp(), fail_code = EXCLUDED.fail_code, fail_status = EXCLUDED.fail_status`,
		account, string(mode), info.Code, info.Status)
	if err != nil {
		return fmt.Errorf("reconcile: recording the events listing of %s: %w", account, err)
	}
	return nil
}
