package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Defaults.
const (
	// DefaultSettle is how long an accepted item waits before a run compares
	// it: Stripe's summaries are eventually consistent.
	DefaultSettle = 2 * time.Hour
	// DefaultSchedule is when the periodic run starts: nightly, 02:00 UTC.
	DefaultSchedule = "0 2 * * *"
)

const (
	hour = int64(3600)
	// heartbeatEvery is how often a running run says it is alive;
	// staleAfter is how long without it makes a run interrupted, so that
	// another may start or resume it.
	heartbeatEvery = 15 * time.Second
	staleAfter     = 2 * time.Minute
	// confirmBatch bounds one T7 statement.
	confirmBatch = 1000
)

// ErrRunning refuses to start a run while another one works.
var ErrRunning = errors.New("reconcile: another run is in progress")

// ErrNotFound is a run id that does not exist.
var ErrNotFound = errors.New("reconcile: no such run")

// DB is what the reconciler needs of the database: a pool.
type DB interface {
	outbox.TxBeginner
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config builds a Reconciler.
type Config struct {
	Outbox *outbox.Store
	// Key, APIBase and Account are the Stripe settings (STRIPE_API_KEY,
	// STRIPE_API_BASE, STRIPE_ACCOUNT).
	Key, APIBase, Account string
	// Destination is where this node exports: a run compares the items
	// staged for it, and only those.
	Destination func() (exporter.Destination, error)
	// Limiter paces every Stripe call of a run (the account's limiter).
	Limiter *exporter.Limiter
	Logger  *slog.Logger
	// Metrics counts the reconciler's Stripe calls; Registry takes the
	// reconciler's own series. Both optional.
	Metrics  *stripeapi.RequestMetrics
	Registry prometheus.Registerer
	// RetryInitial and RetryMax shape the backoff of a read that failed
	// transiently (429, 5xx, no answer): the first wait, and how long a read
	// may keep failing before the run fails. Default 500ms and 2 minutes.
	RetryInitial, RetryMax time.Duration
}

// Reconciler compares accepted items with Stripe's event summaries and
// confirms (T7) what they prove.
type Reconciler struct {
	cfg     Config
	client  *stripeapi.Client
	calls   atomic.Int64
	metrics *metrics
}

// metrics are the reconciler's series; no tenant label.
type metrics struct {
	runs          *prometheus.CounterVec
	confirmed     prometheus.Counter
	discrepancies prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_reconcile_runs_total",
			Help: "Reconcile runs this node worked to an end, by how they ended: succeeded, failed, interrupted.",
		}, []string{"status"}),
		confirmed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_reconcile_items_confirmed_total",
			Help: "Items moved from accepted to confirmed (T7) on Stripe's evidence.",
		}),
		discrepancies: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_reconcile_discrepancies_total",
			Help: "Discrepancies found: hours where Stripe's summary and Tally's accepted items differ, and keys whose summaries Stripe refused (a customer or meter it does not know). A rerun finds an unresolved one again.",
		}),
	}
	for _, s := range []string{"succeeded", "failed", "interrupted"} {
		m.runs.WithLabelValues(s)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.runs, m.confirmed, m.discrepancies} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// New validates cfg and builds the reconciler; it makes no call. Without a
// key it is nil and no error: there is nothing to reconcile against.
func New(cfg Config) (*Reconciler, error) {
	if cfg.Key == "" {
		return nil, nil
	}
	if cfg.Outbox == nil || cfg.Destination == nil || cfg.Limiter == nil {
		return nil, errors.New("reconcile: Outbox, Destination and Limiter are required")
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
	m, err := newMetrics(cfg.Registry)
	if err != nil {
		return nil, err
	}
	r := &Reconciler{cfg: cfg, metrics: m}
	c, err := stripeapi.New(stripeapi.Config{Key: cfg.Key, APIBase: cfg.APIBase, Account: cfg.Account,
		Metrics: cfg.Metrics,
		BeforeRequest: func(ctx context.Context) error {
			r.calls.Add(1)
			return cfg.Limiter.Wait(ctx)
		}})
	if err != nil {
		return nil, err
	}
	r.client = c
	return r, nil
}

// Options are a run's parameters.
type Options struct {
	// Settle: only accepted items older than this are compared (0: all;
	// callers pass TALLY_RECONCILE_SETTLE, by default DefaultSettle).
	// Negative is an error.
	Settle time.Duration
	// Since: only hours from this event time on (zero: all).
	Since time.Time
}

// Trigger says what started a run.
type Trigger string

// The triggers.
const (
	TriggerSchedule Trigger = "schedule"
	TriggerAPI      Trigger = "api"
	TriggerCommand  Trigger = "command"
)

// Queue records a run to be worked later (by the River job); it may run
// inside the caller's transaction.
func Queue(ctx context.Context, q outbox.Querier, trigger Trigger, by string, opts Options) (int64, error) {
	if opts.Settle < 0 {
		return 0, errors.New("reconcile: the settle delay must not be negative")
	}
	var since *time.Time
	if !opts.Since.IsZero() {
		since = &opts.Since
	}
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle, since)
		VALUES ('queued', @trigger, @by, @settle::interval, @since) RETURNING id`,
		pgx.NamedArgs{"trigger": string(trigger), "by": by, "settle": opts.Settle, "since": since}).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("reconcile: queueing a run: %w", err)
	}
	return id, nil
}

// begin marks run id running: a queued run, an interrupted one, or one
// whose worker stopped saying it is alive (the last two resume from their
// cursor). A run that has not been
// heard of for staleAfter is interrupted first, whichever it is.
func begin(ctx context.Context, db DB, id int64) error {
	if _, err := db.Exec(ctx, `UPDATE reconcile_runs SET status = 'interrupted', finished_at = clock_timestamp(),
			error_code = 'no_heartbeat', error = 'the run stopped without finishing (its process died); a rerun or a resume takes over'
		WHERE status = 'running' AND id <> @id AND heartbeat_at < clock_timestamp() - @stale::interval`,
		pgx.NamedArgs{"id": id, "stale": staleAfter}); err != nil {
		return fmt.Errorf("reconcile: interrupting stale runs: %w", err)
	}
	tag, err := db.Exec(ctx, `UPDATE reconcile_runs SET status = 'running', error_code = NULL, error = NULL, finished_at = NULL,
			started_at = coalesce(started_at, clock_timestamp()), heartbeat_at = clock_timestamp()
		WHERE id = @id AND (status IN ('queued', 'interrupted')
			OR (status = 'running' AND heartbeat_at < clock_timestamp() - @stale::interval))`,
		pgx.NamedArgs{"id": id, "stale": staleAfter})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.ConstraintName == "reconcile_runs_one_running" {
		return ErrRunning
	}
	if err != nil {
		return fmt.Errorf("reconcile: starting run %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	run, err := Get(ctx, db, id)
	if err != nil {
		return err
	}
	if run.Status == "running" {
		return ErrRunning
	}
	return fmt.Errorf("reconcile: run %d is %s; it cannot start again", id, run.Status)
}

// RunNow records a run and works it at once, in this process.
func (r *Reconciler) RunNow(ctx context.Context, db DB, trigger Trigger, by string, opts Options) (Run, error) {
	id, err := Queue(ctx, db, trigger, by, opts)
	if err != nil {
		return Run{}, err
	}
	if err := begin(ctx, db, id); err != nil {
		// Nothing was done under this run: it ends failed, visibly.
		_, _ = db.Exec(context.WithoutCancel(ctx), `UPDATE reconcile_runs SET status = 'failed', finished_at = clock_timestamp(),
			error_code = 'not_started', error = @msg WHERE id = @id AND status = 'queued'`,
			pgx.NamedArgs{"id": id, "msg": redact.Message(err.Error())})
		return Run{ID: id}, err
	}
	return r.work(ctx, db, id)
}

// Work works a queued run (or resumes an interrupted one) to its end.
func (r *Reconciler) Work(ctx context.Context, db DB, id int64) (Run, error) {
	if err := begin(ctx, db, id); err != nil {
		return Run{ID: id}, err
	}
	return r.work(ctx, db, id)
}

// work runs a begun run and records how it ended.
func (r *Reconciler) work(ctx context.Context, db DB, id int64) (Run, error) {
	hctx, stop := context.WithCancel(ctx)
	beat := make(chan struct{})
	go func() {
		defer close(beat)
		t := time.NewTicker(heartbeatEvery)
		defer t.Stop()
		for {
			select {
			case <-hctx.Done():
				return
			case <-t.C:
				_, _ = db.Exec(hctx, `UPDATE reconcile_runs SET heartbeat_at = clock_timestamp() WHERE id = $1 AND status = 'running'`, id)
			}
		}
	}()
	err := r.pass(ctx, db, id)
	stop()
	<-beat

	end := context.WithoutCancel(ctx)
	if err != nil {
		code, status, msg := stripeapi.Describe(err)
		info := outbox.ErrorInfo{Code: code, Status: status, Message: msg}
		if errors.Is(err, context.Canceled) {
			info = outbox.ErrorInfo{Code: "canceled", Message: "the run was stopped (shutdown); a resume continues from its last key"}
		}
		info = info.Sanitized()
		status2 := "failed"
		if errors.Is(err, context.Canceled) {
			status2 = "interrupted"
		}
		_, _ = db.Exec(end, `UPDATE reconcile_runs SET status = @status, finished_at = clock_timestamp(),
			error_code = @code, error = nullif(@msg, '') WHERE id = @id AND status = 'running'`,
			pgx.NamedArgs{"id": id, "status": status2, "code": info.Code, "msg": info.Message})
		r.cfg.Logger.Error("reconcile run failed", "run", id, "error", info.String())
		r.metrics.runs.WithLabelValues(status2).Inc()
	} else {
		if _, uerr := db.Exec(end, `UPDATE reconcile_runs SET status = 'succeeded', finished_at = clock_timestamp()
			WHERE id = $1 AND status = 'running'`, id); uerr != nil {
			err = fmt.Errorf("reconcile: finishing run %d: %w", id, uerr)
		}
	}
	run, gerr := Get(end, db, id)
	if gerr != nil && err == nil {
		err = gerr
	}
	if err == nil {
		r.metrics.runs.WithLabelValues("succeeded").Inc()
		r.cfg.Logger.Info("reconcile run finished", "run", id, "keys", run.KeysDone, "hours_compared", run.HoursCompared,
			"hours_matched", run.HoursMatched, "confirmed", run.ItemsConfirmed, "discrepancies", run.Discrepancies,
			"stripe_calls", run.StripeCalls)
	}
	return run, err
}

// key is one (customer, meter) of the destination with settled accepted
// or uncertain items.
type key struct {
	orderingKey, customer, eventName string
	minTS, maxTS                     int64
}

// pass works through the run's keys after its cursor.
func (r *Reconciler) pass(ctx context.Context, db DB, id int64) error {
	dest, err := r.cfg.Destination()
	if err != nil {
		return err
	}
	var (
		settleSec float64
		since     *time.Time
		cursor    string
	)
	if err := db.QueryRow(ctx, `SELECT extract(epoch FROM settle)::float8, since, cursor FROM reconcile_runs WHERE id = $1`, id).
		Scan(&settleSec, &since, &cursor); err != nil {
		return fmt.Errorf("reconcile: reading run %d: %w", id, err)
	}
	settle := time.Duration(settleSec * float64(time.Second))
	sinceTS := int64(0)
	if since != nil {
		sinceTS = since.Unix() - since.Unix()%hour
	}

	start := r.calls.Load()
	var meters []stripeapi.Meter
	if err := r.read(ctx, func() (err error) { meters, err = r.client.Meters(ctx); return err }); err != nil {
		return err
	}
	byEvent := map[string]stripeapi.Meter{}
	for _, m := range meters {
		// The active meter of an event name wins; else any (the events of
		// a deactivated meter still have summaries).
		if cur, ok := byEvent[m.EventName]; !ok || (cur.Status != "active" && m.Status == "active") {
			byEvent[m.EventName] = m
		}
	}

	rows, err := db.Query(ctx, `
SELECT ordering_key, payload ->> 'customer', payload ->> 'event_name',
       min((payload ->> 'timestamp')::bigint), max((payload ->> 'timestamp')::bigint)
FROM outbox_items
WHERE destination_account = @account AND mode = @mode
  AND ((state = 'accepted' AND accepted_at < clock_timestamp() - @settle::interval) OR state = 'uncertain')
  AND (payload ->> 'timestamp')::bigint >= @since
  AND ordering_key > @cursor
GROUP BY 1, 2, 3
ORDER BY 1`, pgx.NamedArgs{"account": dest.Account, "mode": string(dest.Mode), "settle": settle, "since": sinceTS, "cursor": cursor})
	if err != nil {
		return fmt.Errorf("reconcile: listing keys: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (key, error) {
		var k key
		err := row.Scan(&k.orderingKey, &k.customer, &k.eventName, &k.minTS, &k.maxTS)
		return k, err
	})
	if err != nil {
		return fmt.Errorf("reconcile: listing keys: %w", err)
	}
	if _, err := db.Exec(ctx, `UPDATE reconcile_runs SET destination_account = @account, mode = @mode,
			keys_total = keys_done + @n, stripe_calls = stripe_calls + @calls WHERE id = @id`,
		pgx.NamedArgs{"id": id, "account": dest.Account, "mode": string(dest.Mode), "n": len(keys), "calls": r.calls.Load() - start}); err != nil {
		return fmt.Errorf("reconcile: recording run %d: %w", id, err)
	}

	for _, k := range keys {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := r.reconcileKey(ctx, db, id, dest, byEvent, k, settle, sinceTS); err != nil {
			return err
		}
	}
	return nil
}

// reconcileKey compares one key's hours and commits, in one transaction,
// its confirmations, its discrepancies and the run's cursor past it. A key
// whose summaries Stripe refuses with a 4xx about the key is one
// discrepancy (ReasonSummariesRefused) committed the same way, and no
// error: the run goes on to the next key.
func (r *Reconciler) reconcileKey(ctx context.Context, db DB, id int64, dest exporter.Destination,
	byEvent map[string]stripeapi.Meter, k key, settle time.Duration, sinceTS int64) error {
	start := r.calls.Load()
	from := max(k.minTS-k.minTS%hour, sinceTS)
	to := k.maxTS - k.maxTS%hour + hour

	rows, err := db.Query(ctx, `
SELECT id, state, (payload ->> 'value')::bigint, (payload ->> 'timestamp')::bigint,
       state = 'accepted' AND accepted_at < clock_timestamp() - @settle::interval
FROM outbox_items
WHERE ordering_key = @key AND mode = @mode
  AND (payload ->> 'timestamp')::bigint >= @from AND (payload ->> 'timestamp')::bigint < @to
  AND state IN ('accepted', 'confirmed', 'uncertain', 'pending', 'leased')
ORDER BY 4, 1`, pgx.NamedArgs{"key": k.orderingKey, "mode": string(dest.Mode), "settle": settle, "from": from, "to": to})
	if err != nil {
		return fmt.Errorf("reconcile: reading key items: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (held, error) {
		var h held
		err := row.Scan(&h.id, &h.state, &h.value, &h.ts, &h.settled)
		return h, err
	})
	if err != nil {
		return fmt.Errorf("reconcile: reading key items: %w", err)
	}
	byHour := map[int64][]held{}
	var hours []int64
	for _, it := range items {
		h := it.ts - it.ts%hour
		if _, ok := byHour[h]; !ok {
			hours = append(hours, h)
		}
		byHour[h] = append(byHour[h], it)
	}

	var (
		compared, matched, skipped int
		confirm                    []int64
		found                      []Discrepancy
	)
	m, ok := byEvent[k.eventName]
	var summaries []stripeapi.Summary
	if ok {
		err = r.read(ctx, func() (err error) {
			summaries, err = r.client.EventSummaries(ctx, m.ID, k.customer, from, to, stripeapi.Hour)
			return err
		})
	}
	refusal, refused := refusedKey(ctx, err)
	switch {
	case !ok:
		// No meter has the event name any more: nothing to read evidence
		// from. The hours are skipped, visibly in the run's totals.
		r.cfg.Logger.Warn("reconcile: no meter for an event name with accepted items", "event_name", k.eventName)
		for _, h := range hours {
			if worthComparing(byHour[h]) {
				skipped++
			}
		}
	case refused:
		// Stripe refused this key alone (a customer or a meter it does not
		// know): nothing of the key is compared; the key is a discrepancy
		// of its own, with the items it holds, and the run goes on.
		u := holdOver(m.Formula, byHour, hours)
		skipped += u.skipped
		found = append(found, Discrepancy{Account: dest.Account, Mode: string(dest.Mode), EventName: k.eventName, Meter: m.ID,
			Customer: k.customer, Reason: ReasonSummariesRefused, ErrorCode: refusal.Code, ErrorStatus: refusal.Status,
			Hour: time.Unix(from, 0).UTC(), Formula: m.Formula, Expected: u.expected.String(),
			ExpectedItems: u.counted, UncertainItems: u.uncertain, ExplainedBy: []int64{}, Explanation: ExplanationNotCompared})
		r.cfg.Logger.Warn("reconcile: Stripe refused a key's summaries; the key is recorded as a discrepancy and the run goes on",
			"run", id, "event_name", k.eventName, "meter", m.ID, "error", refusal.String(), "hours", u.hours,
			"items", len(u.counted)+len(u.uncertain))
	case err != nil:
		return err
	default:
		provider := map[int64]float64{}
		for _, s := range summaries {
			provider[s.Start] = s.Value
		}
		for _, h := range hours {
			if !worthComparing(byHour[h]) {
				continue // nothing this run would confirm or learn
			}
			value, inSummary := provider[h]
			v := compareHour(m.Formula, byHour[h], value, inSummary)
			switch {
			case v.skip != "":
				skipped++
			case v.match:
				compared++
				matched++
				confirm = append(confirm, v.confirm...)
			default:
				compared++
				d := Discrepancy{Account: dest.Account, Mode: string(dest.Mode), EventName: k.eventName, Meter: m.ID,
					Customer: k.customer, Reason: ReasonMismatch, Hour: time.Unix(h, 0).UTC(), Formula: m.Formula,
					Expected: v.expected.String(), ExpectedItems: nonNil(v.counted), UncertainItems: nonNil(v.uncertain),
					ExplainedBy: nonNil(v.explainedBy), Explanation: v.explanation}
				if v.provider != nil {
					p, diff := v.providerText, v.differenceText()
					d.Provider, d.Difference = &p, &diff
				}
				found = append(found, d)
			}
		}
	}

	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	confirmed := 0
	for len(confirm) > 0 {
		n := min(len(confirm), confirmBatch)
		done, refused, err := r.cfg.Outbox.Confirm(ctx, tx, confirm[:n])
		if err != nil {
			return err
		}
		confirmed += len(done)
		for itemID, rerr := range refused {
			// The item moved since it was read (an operator recovered it,
			// say): it is left as it is and the next run looks again.
			r.cfg.Logger.Warn("reconcile: an item changed before it could be confirmed", "item", itemID, "error", rerr)
		}
		confirm = confirm[n:]
	}
	for i := range found {
		d := &found[i]
		rows, err := tx.Query(ctx, `SELECT DISTINCT item_id FROM meter_error_evidence WHERE item_id = ANY($1) ORDER BY 1`, d.ExpectedItems)
		if err != nil {
			return fmt.Errorf("reconcile: reading evidence: %w", err)
		}
		if d.ReportedItems, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
			return fmt.Errorf("reconcile: reading evidence: %w", err)
		}
		d.ReportedItems = nonNil(d.ReportedItems)
		var provider, diff *string
		if d.Provider != nil {
			provider, diff = d.Provider, d.Difference
		}
		var errCode *string
		var errStatus *int
		if d.Reason != ReasonMismatch {
			errCode, errStatus = &d.ErrorCode, &d.ErrorStatus
		}
		if _, err := tx.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter, customer,
				reason, error_code, error_status, hour, formula, expected, provider, difference, expected_items, uncertain_items,
				explained_by, explanation, reported_items)
			VALUES (@run, @account, @mode, @event, @meter, @customer, @reason, @error_code, @error_status, @hour, @formula,
				@expected::numeric, @provider::numeric, @diff::numeric, @expected_items, @uncertain_items, @explained_by,
				@explanation, @reported)
			ON CONFLICT DO NOTHING`,
			pgx.NamedArgs{"run": id, "account": d.Account, "mode": d.Mode, "event": d.EventName, "meter": d.Meter,
				"customer": d.Customer, "reason": d.Reason, "error_code": errCode, "error_status": errStatus,
				"hour": d.Hour, "formula": d.Formula, "expected": d.Expected, "provider": provider,
				"diff": diff, "expected_items": d.ExpectedItems, "uncertain_items": d.UncertainItems,
				"explained_by": d.ExplainedBy, "explanation": d.Explanation, "reported": d.ReportedItems}); err != nil {
			return fmt.Errorf("reconcile: recording a discrepancy: %w", err)
		}
	}
	if _, err := tx.Exec(ctx, `UPDATE reconcile_runs SET cursor = @cursor, keys_done = keys_done + 1,
			hours_compared = hours_compared + @compared, hours_matched = hours_matched + @matched,
			hours_skipped = hours_skipped + @skipped, items_confirmed = items_confirmed + @confirmed,
			discrepancies = discrepancies + @found, stripe_calls = stripe_calls + @calls, heartbeat_at = clock_timestamp()
		WHERE id = @id AND status = 'running'`,
		pgx.NamedArgs{"id": id, "cursor": k.orderingKey, "compared": compared, "matched": matched, "skipped": skipped,
			"confirmed": confirmed, "found": len(found), "calls": r.calls.Load() - start}); err != nil {
		return fmt.Errorf("reconcile: recording progress: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	r.metrics.confirmed.Add(float64(confirmed))
	r.metrics.discrepancies.Add(float64(len(found)))
	return nil
}

// read runs a Stripe read, again with exponential backoff and jitter after
// a transient failure (429 — which also slows the account's limiter — 409,
// 5xx, no answer), until it succeeds, fails for good, or RetryMax has
// passed.
func (r *Reconciler) read(ctx context.Context, f func() error) error {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxElapsedTime = r.cfg.RetryInitial, r.cfg.RetryMax
	return backoff.Retry(func() error {
		sent := time.Now()
		err := f()
		if err == nil || ctx.Err() != nil {
			return err
		}
		code, status, _ := stripeapi.Describe(err)
		switch {
		case status == http.StatusTooManyRequests:
			r.cfg.Limiter.Slow(sent)
		case status >= 500, status == http.StatusConflict, code == stripeapi.CodeNetwork, code == stripeapi.CodeTimeout:
		default:
			return backoff.Permanent(err)
		}
		r.cfg.Logger.Debug("reconcile: a Stripe read failed; trying again", "status", status)
		return err
	}, backoff.WithContext(b, ctx))
}

// refusedKey says whether err, the end of a key's summaries read, is
// Stripe refusing that key alone — a 4xx about the request (400, 404: a
// customer Stripe does not know or deleted, a meter it no longer has; 402,
// …) — and gives the refusal, content-free: Stripe's code (else its error
// type) and the status. 401 and 403 refuse the key Tally calls with, so
// every key (the run fails); 409 and 429 are transient (read retries them);
// a cancelled run is not a refusal.
func refusedKey(ctx context.Context, err error) (outbox.ErrorInfo, bool) {
	if err == nil || ctx.Err() != nil {
		return outbox.ErrorInfo{}, false
	}
	code, status, _ := stripeapi.Describe(err)
	switch {
	case status < 400 || status > 499:
		return outbox.ErrorInfo{}, false
	case status == http.StatusUnauthorized, status == http.StatusForbidden,
		status == http.StatusConflict, status == http.StatusTooManyRequests:
		return outbox.ErrorInfo{}, false
	}
	return outbox.ErrorInfo{Code: code, Status: status}.Sanitized(), true
}

// worthComparing: an hour with a settled accepted item (to confirm) or an
// uncertain one (to learn whether it landed).
func worthComparing(items []held) bool {
	for _, it := range items {
		if (it.state == outbox.StateAccepted && it.settled) || it.state == outbox.StateUncertain {
			return true
		}
	}
	return false
}

func nonNil(s []int64) []int64 {
	if s == nil {
		return []int64{}
	}
	return s
}
