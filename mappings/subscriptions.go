package mappings

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
)

// A tenant whose customer has a subscription billing a mapped meter bills
// by that subscription's periods: its period anchor is the subscription's
// billing cycle anchor, read from Stripe (SyncSubscriptions) when the
// tenant is mapped, when a customer.subscription.* event arrives and every
// day. A monthly price's periods start on the anchor's day and time each
// month, on the last day of a shorter month, as the periods of a tenant's
// anchor do. A tenant without such a subscription keeps the anchor its
// operator set.

// SubscriptionLister reads a customer's metered subscription items.
type SubscriptionLister interface {
	// SubscriptionItems lists the metered items of every subscription of
	// the customer in account ("" for the node's destination), any status.
	SubscriptionItems(ctx context.Context, account, customer string) ([]stripeapi.SubscriptionItem, error)
}

// SubscriptionItems implements SubscriptionLister.
func (s StripeMeters) SubscriptionItems(ctx context.Context, account, customer string) ([]stripeapi.SubscriptionItem, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return nil, accountUnreachable(account)
	}
	items, err := c.SubscriptionItems(ctx, customer)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		return nil, &ErrProviderUnavailable{Code: code, Status: status}
	}
	return items, nil
}

// ActorStripe is the audit actor of the tenant mapping versions a
// subscription's billing cycle anchor made.
const ActorStripe = "stripe"

// sqlItemStore keeps one item as Stripe listed it, stamped by the
// database's clock (the new row's read_at: a distributed database refuses
// a function that is not IMMUTABLE in DO UPDATE SET).
const sqlItemStore = `
INSERT INTO stripe_subscription_items (account, item, customer, subscription, status, price, meter, currency,
    billing_interval, interval_count, billing_cycle_anchor, current_period_start, current_period_end, start_date, ended_at)
VALUES (@account, @item, @customer, @subscription, @status, @price, @meter, @currency,
    @interval, @interval_count, @anchor, @period_start, @period_end, @start_date, @ended_at)
ON CONFLICT (account, item) DO UPDATE SET customer = EXCLUDED.customer, subscription = EXCLUDED.subscription,
    status = EXCLUDED.status, price = EXCLUDED.price, meter = EXCLUDED.meter, currency = EXCLUDED.currency,
    billing_interval = EXCLUDED.billing_interval, interval_count = EXCLUDED.interval_count,
    billing_cycle_anchor = EXCLUDED.billing_cycle_anchor, current_period_start = EXCLUDED.current_period_start,
    current_period_end = EXCLUDED.current_period_end, start_date = EXCLUDED.start_date, ended_at = EXCLUDED.ended_at,
    gone_at = NULL, read_at = EXCLUDED.read_at`

// sqlItemsGone marks the customer's items Stripe no longer lists (a
// deleted item), stamped @at: the database's clock read in the same
// transaction, as a distributed database refuses a volatile function in an
// UPDATE of a reference table. One index range of the customer's items.
const sqlItemsGone = `
UPDATE stripe_subscription_items SET gone_at = @at
WHERE account = @account AND customer = @customer AND gone_at IS NULL AND NOT item = ANY(@listed::text[])`

// sqlBillingItems reads the customer's live items whose meter a feature
// mapping names (through the meter directory, by the meter's event name),
// and whether each item's current period ends where the monthly periods of
// its subscription's anchor do.
const sqlBillingItems = `
SELECT i.subscription, i.item, i.billing_interval, i.interval_count, i.billing_cycle_anchor,
       tally_period_end(i.current_period_start, i.billing_cycle_anchor) = i.current_period_end
FROM stripe_subscription_items i
WHERE i.account = @account AND i.customer = @customer AND i.gone_at IS NULL AND i.ended_at IS NULL
  AND i.status IN ('active', 'trialing', 'past_due', 'unpaid', 'paused')
  AND EXISTS (SELECT 1 FROM stripe_meters m JOIN feature_mappings f ON f.event_name = m.event_name WHERE m.id = i.meter)
ORDER BY i.subscription, i.item`

// sqlReadStore keeps what a read of the customer gave.
const sqlReadStore = `
INSERT INTO stripe_subscription_reads (account, customer, anchor, subscription, problem)
VALUES (@account, @customer, @anchor, NULLIF(@subscription, ''), NULLIF(@problem, ''))
ON CONFLICT (account, customer) DO UPDATE SET read_at = EXCLUDED.read_at, anchor = EXCLUDED.anchor,
    subscription = EXCLUDED.subscription, problem = EXCLUDED.problem`

// BillingPeriods is what a customer's subscriptions say of its periods.
type BillingPeriods struct {
	// Anchor is the billing cycle anchor of the subscription the tenant
	// bills by; nil when none gives one (no metered subscription on a
	// mapped meter, or a Problem).
	Anchor *time.Time `json:"anchor,omitempty"`
	// Subscription is the subscription Anchor comes from.
	Subscription string `json:"subscription,omitempty"`
	// Problem says why no anchor could be taken although the customer has
	// live items on mapped meters: the tenant keeps its anchor.
	Problem string `json:"problem,omitempty"`
}

// periodsOf derives the customer's billing periods from its live items on
// mapped meters: none gives no anchor; every item monthly, of one anchor,
// with its current period where that anchor's months put it, gives that
// anchor; anything else is a problem, said in words.
func periodsOf(ctx context.Context, q pgdb.Querier, account, customer string) (BillingPeriods, error) {
	rows, err := q.Query(ctx, sqlBillingItems, pgx.NamedArgs{"account": account, "customer": customer})
	if err != nil {
		return BillingPeriods{}, err
	}
	var (
		p                  BillingPeriods
		sub, item, every   string
		count              int
		anchor             time.Time
		fits               bool
		anchors, unmonthly []string
	)
	_, err = pgx.ForEachRow(rows, []any{&sub, &item, &every, &count, &anchor, &fits}, func() error {
		a := anchor.UTC()
		switch {
		case every != "month" || count != 1:
			unmonthly = append(unmonthly, fmt.Sprintf("%s bills every %d %s", sub, count, every))
		case !fits:
			p.Problem = fmt.Sprintf("item %s of %s has a current period that is not a month of its anchor %s", item, sub, a.Format(time.RFC3339))
		case p.Anchor == nil:
			p.Anchor, p.Subscription = &a, sub
			anchors = append(anchors, sub+" "+a.Format(time.RFC3339))
		case !p.Anchor.Equal(a):
			anchors = append(anchors, sub+" "+a.Format(time.RFC3339))
		}
		return nil
	})
	if err != nil {
		return BillingPeriods{}, err
	}
	switch {
	case len(unmonthly) > 0:
		p.Problem = "Tally bills by monthly periods only: " + strings.Join(unmonthly, "; ")
	case len(anchors) > 1:
		p.Problem = "subscriptions with different billing cycle anchors bill mapped meters: " + strings.Join(anchors, ", ")
	}
	if p.Problem != "" {
		p.Anchor, p.Subscription = nil, ""
		if len(p.Problem) > 300 {
			p.Problem = p.Problem[:297] + "..."
		}
	}
	return p, nil
}

// SubscriptionSync says what one SyncSubscriptions did.
type SubscriptionSync struct {
	Items   int
	Periods BillingPeriods
	// Anchored are the tenants whose anchor it changed.
	Anchored []string
}

// SyncSubscriptions reads the customer's metered subscription items from
// Stripe (before any transaction) and, in one transaction, keeps them,
// derives the customer's billing periods and sets them as the period
// anchor of every tenant mapped to the customer (a new mapping version
// by ActorStripe, its unstaged usage moved to the new periods).
func (s *Store) SyncSubscriptions(ctx context.Context, db pgdb.Beginner, lister SubscriptionLister, account, customer string) (SubscriptionSync, error) {
	items, err := lister.SubscriptionItems(ctx, account, customer)
	if err != nil {
		return SubscriptionSync{}, fmt.Errorf("mappings: reading the subscriptions of %s: %w", customer, err)
	}
	var res SubscriptionSync
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		res, err = s.keepSubscriptions(ctx, tx, account, customer, items)
		return err
	})
	if err != nil {
		return SubscriptionSync{}, fmt.Errorf("mappings: keeping the subscriptions of %s: %w", customer, err)
	}
	return res, nil
}

// keepSubscriptions stores items as the customer's, in tx, and anchors
// its tenants by them.
func (s *Store) keepSubscriptions(ctx context.Context, tx pgx.Tx, account, customer string, items []stripeapi.SubscriptionItem) (SubscriptionSync, error) {
	res := SubscriptionSync{Items: len(items)}
	listed := make([]string, 0, len(items))
	for _, it := range items {
		var ended *time.Time
		if !it.EndedAt.IsZero() {
			ended = &it.EndedAt
		}
		if it.CurrentPeriodEnd.After(it.CurrentPeriodStart) {
			if _, err := tx.Exec(ctx, sqlItemStore, pgx.NamedArgs{"account": account, "item": it.ID, "customer": customer,
				"subscription": it.Subscription, "status": it.Status, "price": it.Price, "meter": it.Meter, "currency": it.Currency,
				"interval": it.Interval, "interval_count": it.IntervalCount, "anchor": it.BillingCycleAnchor,
				"period_start": it.CurrentPeriodStart, "period_end": it.CurrentPeriodEnd, "start_date": it.StartDate, "ended_at": ended}); err != nil {
				return res, err
			}
			listed = append(listed, it.ID)
		}
	}
	var at time.Time
	if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&at); err != nil {
		return res, err
	}
	args := pgx.NamedArgs{"account": account, "customer": customer, "listed": listed, "at": at}
	if _, err := tx.Exec(ctx, sqlItemsGone, args); err != nil {
		return res, err
	}
	p, err := s.anchorCustomer(ctx, tx, account, customer)
	res.Periods = p.periods
	res.Anchored = p.anchored
	return res, err
}

type anchored struct {
	periods  BillingPeriods
	anchored []string
}

// anchorCustomer derives the customer's periods from its stored items,
// keeps them, and sets the anchor of each tenant mapped to it that bills
// otherwise.
func (s *Store) anchorCustomer(ctx context.Context, tx pgx.Tx, account, customer string) (anchored, error) {
	p, err := periodsOf(ctx, tx, account, customer)
	if err != nil {
		return anchored{}, err
	}
	out := anchored{periods: p}
	if _, err := tx.Exec(ctx, sqlReadStore, pgx.NamedArgs{"account": account, "customer": customer, "anchor": p.Anchor,
		"subscription": p.Subscription, "problem": p.Problem}); err != nil {
		return out, err
	}
	if p.Anchor == nil {
		return out, nil
	}
	rows, err := tx.Query(ctx, "SELECT "+tenantColumns+` FROM tenant_mappings
		WHERE coalesce(stripe_account, '') = $1 AND stripe_customer_id = $2 ORDER BY tenant FOR UPDATE`, account, customer)
	if err != nil {
		return out, err
	}
	tenants, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
	if err != nil {
		return out, err
	}
	for _, cur := range tenants {
		if sameAnchor(cur.PeriodAnchor, p.Anchor) {
			continue
		}
		in := TenantInput{StripeCustomerID: cur.StripeCustomerID, StripeAccount: cur.StripeAccount, PeriodAnchor: p.Anchor, InvoiceGrace: cur.InvoiceGrace}
		if _, err := s.writeTenant(ctx, tx, cur.Tenant, in, ActorStripe, &cur, "the billing cycle anchor of subscription "+p.Subscription); err != nil {
			return out, err
		}
		out.anchored = append(out.anchored, cur.Tenant)
	}
	return out, nil
}

// SyncCustomer reads again the subscriptions of a customer id in every
// account a current tenant mapping names it in (SyncSubscriptions for
// each), as a customer.subscription.* event asks: customer ids are
// Stripe's, unique across accounts. It returns how many accounts it read
// (0: no tenant maps the customer).
func (s *Store) SyncCustomer(ctx context.Context, db pgdb.Beginner, lister SubscriptionLister, customer string) (int, error) {
	accounts, err := CustomerAccounts(ctx, db, customer)
	if err != nil {
		return 0, err
	}
	for _, account := range accounts {
		if _, err := s.SyncSubscriptions(ctx, db, lister, account, customer); err != nil {
			return 0, err
		}
	}
	return len(accounts), nil
}

// CustomerAccounts lists the accounts ("" for the node's destination)
// that current tenant mappings name the customer in, each once.
func CustomerAccounts(ctx context.Context, q pgdb.Querier, customer string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT coalesce(stripe_account, '') FROM tenant_mappings WHERE stripe_customer_id = $1 ORDER BY 1`, customer)
	if err != nil {
		return nil, fmt.Errorf("mappings: finding the tenants of %s: %w", customer, err)
	}
	accounts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("mappings: finding the tenants of %s: %w", customer, err)
	}
	return accounts, nil
}

// StoredPeriods reads what the last read of the customer's subscriptions
// gave; false when it was never read.
func StoredPeriods(ctx context.Context, q pgdb.Querier, account, customer string) (BillingPeriods, bool, error) {
	var (
		p            BillingPeriods
		sub, problem *string
	)
	err := q.QueryRow(ctx, `SELECT anchor, subscription, problem FROM stripe_subscription_reads WHERE account = $1 AND customer = $2`,
		account, customer).Scan(&p.Anchor, &sub, &problem)
	if errors.Is(err, pgx.ErrNoRows) {
		return BillingPeriods{}, false, nil
	}
	if err != nil {
		return BillingPeriods{}, false, fmt.Errorf("mappings: reading a customer's billing periods: %w", err)
	}
	if p.Anchor != nil {
		a := p.Anchor.UTC()
		p.Anchor = &a
	}
	if sub != nil {
		p.Subscription = *sub
	}
	if problem != nil {
		p.Problem = *problem
	}
	return p, true, nil
}

// sqlStaleSubscriptions lists the customers of current tenant mappings
// whose subscriptions were never read or were read longer than @ttl ago,
// never read first: its cost grows with the tenants, not with usage.
const sqlStaleSubscriptions = `
SELECT a.account, a.customer
FROM (SELECT DISTINCT coalesce(stripe_account, '') AS account, stripe_customer_id AS customer FROM tenant_mappings) a
LEFT JOIN stripe_subscription_reads r ON r.account = a.account AND r.customer = a.customer
WHERE r.read_at IS NULL OR r.read_at < clock_timestamp() - @ttl::interval
ORDER BY r.read_at NULLS FIRST, a.account, a.customer
LIMIT @batch`

// sqlReadCustomers lists the customers read whose live items gave no
// anchor: their anchors are derived again from the stored items, without
// Stripe, since a feature mapping or the meter directory (read hourly) may
// since have made their items count. It grows with those customers only.
const sqlReadCustomers = `
SELECT r.account, r.customer FROM stripe_subscription_reads r
WHERE r.anchor IS NULL
  AND EXISTS (SELECT 1 FROM stripe_subscription_items i
              WHERE i.account = r.account AND i.customer = r.customer AND i.gone_at IS NULL AND i.ended_at IS NULL)
ORDER BY r.account, r.customer`

// SubscriptionsRead says what one RefreshSubscriptions did.
type SubscriptionsRead struct {
	// Read is how many customers Stripe answered; Unreadable how many it
	// did not (read again on the next pass).
	Read, Unreadable int
	// Anchored are the tenants whose anchor changed.
	Anchored []string
}

// RefreshSubscriptions reads again from Stripe the subscriptions of at
// most batch customers of current tenant mappings that were never read or
// were read longer than ttl ago, then derives again from what is stored
// the periods of the customers whose live items gave none.
func (s *Store) RefreshSubscriptions(ctx context.Context, db pgdb.Beginner, lister SubscriptionLister, ttl time.Duration, batch int) (SubscriptionsRead, error) {
	type key struct{ account, customer string }
	list := func(sql string, args pgx.NamedArgs) ([]key, error) {
		rows, err := db.Query(ctx, sql, args)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, func(r pgx.CollectableRow) (key, error) {
			var k key
			return k, r.Scan(&k.account, &k.customer)
		})
	}
	var res SubscriptionsRead
	stale, err := list(sqlStaleSubscriptions, pgx.NamedArgs{"ttl": ttl, "batch": batch})
	if err != nil {
		return res, fmt.Errorf("mappings: listing the subscriptions to read: %w", err)
	}
	for _, k := range stale {
		r, err := s.SyncSubscriptions(ctx, db, lister, k.account, k.customer)
		var unavailable *ErrProviderUnavailable
		var account *AccountError
		switch {
		case errors.As(err, &unavailable) || errors.As(err, &account):
			res.Unreadable++
			continue
		case err != nil:
			return res, err
		}
		res.Read++
		res.Anchored = append(res.Anchored, r.Anchored...)
	}
	read, err := list(sqlReadCustomers, nil)
	if err != nil {
		return res, fmt.Errorf("mappings: listing the read customers: %w", err)
	}
	for _, k := range read {
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			a, err := s.anchorCustomer(ctx, tx, k.account, k.customer)
			res.Anchored = append(res.Anchored, a.anchored...)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("mappings: deriving the billing periods of %s: %w", k.customer, err)
		}
	}
	return res, nil
}

// SubscriptionsArgs is the River job that reads again the subscriptions
// older than its worker's TTL.
type SubscriptionsArgs struct{}

// Kind names the job.
func (SubscriptionsArgs) Kind() string { return "tally_subscriptions" }

// DefaultSubscriptionsTTL is how old a customer's read may be before the
// job reads it again.
const DefaultSubscriptionsTTL = 24 * time.Hour

// SubscriptionsWorker runs SubscriptionsArgs: RefreshSubscriptions with its
// TTL and batch (DefaultNamesBatch).
type SubscriptionsWorker struct {
	river.WorkerDefaults[SubscriptionsArgs]
	DB     pgdb.Beginner
	Store  *Store
	Lister SubscriptionLister
	TTL    time.Duration
	Batch  int
	Logger *slog.Logger
}

// Work reads the stale subscriptions.
func (w *SubscriptionsWorker) Work(ctx context.Context, _ *river.Job[SubscriptionsArgs]) error {
	ttl, batch := w.TTL, w.Batch
	if ttl <= 0 {
		ttl = DefaultSubscriptionsTTL
	}
	if batch <= 0 {
		batch = DefaultNamesBatch
	}
	res, err := w.Store.RefreshSubscriptions(ctx, w.DB, w.Lister, ttl, batch)
	if err != nil {
		return err
	}
	if res.Unreadable > 0 {
		w.Logger.WarnContext(ctx, "subscriptions: Stripe could not be asked about some customers; they are read again next hour",
			"read", res.Read, "unreadable", res.Unreadable)
	}
	if len(res.Anchored) > 0 {
		w.Logger.InfoContext(ctx, "subscriptions: tenants now bill by their subscription's periods", "tenants", len(res.Anchored))
	}
	return nil
}

// Timeout lets a run wait for Stripe for up to ten minutes.
func (w *SubscriptionsWorker) Timeout(*river.Job[SubscriptionsArgs]) time.Duration {
	return 10 * time.Minute
}

// PeriodicSubscriptions is the subscriptions job every hour and when
// River's leader starts, unique in the cluster, on the names' queue.
func PeriodicSubscriptions() *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(time.Hour), func() (river.JobArgs, *river.InsertOpts) {
		return SubscriptionsArgs{}, &river.InsertOpts{MaxAttempts: 1, Queue: NamesQueue, UniqueOpts: river.UniqueOpts{
			ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
				rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
		}}
	}, &river.PeriodicJobOpts{ID: "tally_subscriptions", RunOnStart: true})
}
