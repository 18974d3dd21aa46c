package console

import (
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// ---- Overview

type stateCount struct {
	State string
	Count int64
	Bad   bool
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	g, err := c.Outbox.ReadGauge(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var states []stateCount
	for _, st := range outbox.States {
		bad := (st == outbox.StateUncertain || st == outbox.StateRejected || st == outbox.StateQuarantined) && g.Counts[st] > 0
		states = append(states, stateCount{State: string(st), Count: g.Counts[st], Bad: bad})
	}
	// The backlog: the maintenance pass's snapshots of the last 24 hours.
	rows, err := c.pool.Query(ctx, `SELECT at, state, items FROM outbox_snapshots
		WHERE at > clock_timestamp() - interval '24 hours' AND state IN ('pending', 'leased', 'quarantined', 'uncertain')
		ORDER BY at`)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	series := map[string][]point{}
	var (
		at    time.Time
		state string
		n     int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&at, &state, &n}, func() error {
		series[state] = append(series[state], point{at, float64(n)})
		return nil
	}); err != nil {
		c.fail(w, r, err)
		return
	}
	// The export rate: accepted outcomes per hour, from the attempt log.
	rows, err = c.pool.Query(ctx, `SELECT date_trunc('hour', recorded_at) AS h, count(*) FROM outbox_attempts
		WHERE outcome = 'accepted' AND recorded_at > clock_timestamp() - interval '24 hours' GROUP BY 1 ORDER BY 1`)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var rate []point
	if _, err := pgx.ForEachRow(rows, []any{&at, &n}, func() error {
		rate = append(rate, point{at, float64(n)})
		return nil
	}); err != nil {
		c.fail(w, r, err)
		return
	}
	now := time.Now()
	c.render(w, r, "overview", "Overview", struct {
		States        []stateCount
		OldestPending string
		BacklogChart  template.HTML
		RateChart     template.HTML
	}{states, (time.Duration(g.OldestPendingAgeSeconds) * time.Second).String(),
		lineChart(series, []string{"pending", "leased", "quarantined", "uncertain"}, now.Add(-24*time.Hour), now, "items"),
		barChart(rate, now.Add(-24*time.Hour), now, "accepted")})
}

// ---- Quarantine

type quarantinedItem struct {
	ID                          int64
	Reason, Tenant, Feature     string
	Period, Value               string
	ItemVersion, CurrentVersion int
}

func filterOf(r *http.Request) quarantine.Filter {
	q := r.URL.Query()
	return quarantine.Filter{Reason: q.Get("reason"), Tenant: q.Get("tenant"), Feature: q.Get("feature"), Period: q.Get("period")}
}

func (c *Console) quarantine(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	f := filterOf(r)
	rep, err := quarantine.Quarantined(ctx, c.pool, f)
	if err != nil {
		// A malformed period is the user's: show the page unfiltered by it.
		f.Period = ""
		if rep, err = quarantine.Quarantined(ctx, c.pool, f); err != nil {
			c.fail(w, r, err)
			return
		}
	}
	var from, to time.Time
	if f.Period != "" {
		from, to, _ = quarantine.ParsePeriod(f.Period)
	}
	rows, err := c.pool.Query(ctx, `
		SELECT o.id, o.quarantine_reason, o.tenant_key, coalesce(o.payload ->> 'feature', ''), coalesce(o.payload ->> 'period', ''),
		       o.payload ->> 'value', o.mapping_version,
		       greatest(coalesce(fm.version, 0), coalesce(tm.version, 0))
		FROM outbox_items o
		LEFT JOIN feature_mappings fm ON fm.feature = o.payload ->> 'feature'
		LEFT JOIN tenant_mappings tm ON tm.tenant = o.tenant_key
		WHERE o.state = 'quarantined'
		  AND (@reason = '' OR o.quarantine_reason = @reason) AND (@tenant = '' OR o.tenant_key = @tenant)
		  AND (@feature = '' OR o.payload ->> 'feature' = @feature)
		  AND (@period = '' OR ((o.payload ->> 'period')::timestamptz >= @from AND (o.payload ->> 'period')::timestamptz < @to))
		ORDER BY o.id LIMIT 500`,
		pgx.NamedArgs{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature, "period": f.Period, "from": from, "to": to})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (quarantinedItem, error) {
		var it quarantinedItem
		err := row.Scan(&it.ID, &it.Reason, &it.Tenant, &it.Feature, &it.Period, &it.Value, &it.ItemVersion, &it.CurrentVersion)
		return it, err
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	csv := url.Values{}
	for k, v := range map[string]string{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature, "period": f.Period} {
		if v != "" {
			csv.Set(k, v)
		}
	}
	c.render(w, r, "quarantine", "Quarantine", struct {
		Filter  quarantine.Filter
		Reasons []string
		Report  quarantine.Report
		Items   []quarantinedItem
		CSVHref string
	}{f, reasonNames(), rep, items, "/console/quarantine.csv?" + csv.Encode()})
}

// reasonNames lists every quarantine reason, the outbox's list, for the
// filter.
func reasonNames() []string {
	out := make([]string, len(outbox.Reasons))
	for i, r := range outbox.Reasons {
		out[i] = string(r)
	}
	return out
}

// quarantineCSV is the report as CSV, safe to open in a spreadsheet.
func (c *Console) quarantineCSV(w http.ResponseWriter, r *http.Request) {
	rep, err := quarantine.Quarantined(r.Context(), c.pool, filterOf(r))
	if err != nil {
		http.Error(w, "the period must be YYYY-MM", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="tally-quarantine.csv"`)
	if err := rep.CSV(w); err != nil {
		c.Logger.ErrorContext(r.Context(), "writing the quarantine CSV failed", "error", err)
	}
}

func (c *Console) requeue(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	version, err := strconv.Atoi(r.PostFormValue("mapping_version"))
	if !ok || err != nil {
		http.Error(w, "an item id and a mapping version are required", http.StatusBadRequest)
		return
	}
	res, err := c.Requeuer.Requeue(r.Context(), c.pool, id, version, actor(r))
	var (
		mc *quarantine.MappingChangedError
		ie *quarantine.StillIneligibleError
		se *outbox.StateError
	)
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		http.NotFound(w, r)
	case err == nil && res.Action == quarantine.ActionReaddressed:
		back(w, r, "/console/quarantine", "readdressed")
	case err == nil:
		back(w, r, "/console/quarantine", "requeued")
	case errors.As(err, &mc):
		back(w, r, "/console/quarantine", "mapping_changed")
	case errors.As(err, &ie):
		back(w, r, "/console/quarantine", "still_ineligible")
	case errors.Is(err, outbox.ErrMayHaveReached):
		back(w, r, "/console/quarantine", "may_have_reached")
	case errors.As(err, &se):
		back(w, r, "/console/quarantine", "not_quarantined")
	case quarantine.IsConflict(err):
		back(w, r, "/console/quarantine", "requeue_refused")
	default:
		c.fail(w, r, err)
	}
}

// ---- Item

func (c *Console) item(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	id, ok := itemID(r)
	if !ok {
		http.NotFound(w, r)
		return
	}
	it, err := c.Outbox.Get(ctx, c.pool, id)
	if errors.Is(err, outbox.ErrNotFound) {
		http.NotFound(w, r)
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	attempts, err := c.Outbox.Attempts(ctx, c.pool, id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	evidence, err := reconcile.EvidenceOf(ctx, c.pool, []int64{id})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	trail, err := audit.List(ctx, c.pool, audit.Item(id), 100)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "item", fmt.Sprintf("Item %d", id), struct {
		Item     outbox.Item
		Payload  string
		Attempts []outbox.Attempt
		Evidence []reconcile.Evidence
		Audit    []audit.Entry
	}{it, prettyJSON(it.Payload), attempts, evidence, trail})
}

// ---- Uncertain and rejected

type doubtfulItem struct {
	ID                            int64
	State, Tenant, Feature, Value string
	Attempts, Refused             int
	LastError, Suggestion         string
}

func (c *Console) uncertain(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	rows, err := c.pool.Query(ctx, `
		SELECT id, state, tenant_key, coalesce(payload ->> 'feature', ''), payload ->> 'value', attempts, refused_attempts,
		       coalesce(last_error_code || coalesce(' (' || last_error_status || ')', '') || coalesce(': ' || last_error, ''), '')
		FROM outbox_items WHERE state IN ('uncertain', 'rejected') ORDER BY state DESC, id LIMIT 500`)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (doubtfulItem, error) {
		var it doubtfulItem
		err := row.Scan(&it.ID, &it.State, &it.Tenant, &it.Feature, &it.Value, &it.Attempts, &it.Refused, &it.LastError)
		return it, err
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The latest finished run's plan suggests recoveries.
	var runID *int64
	if err := c.pool.QueryRow(ctx, `SELECT max(id) FROM reconcile_runs WHERE status = 'succeeded'`).Scan(&runID); err != nil {
		c.fail(w, r, err)
		return
	}
	if runID != nil {
		plan, err := reconcile.PlanOf(ctx, c.pool, c.Outbox, *runID)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		suggest := map[int64]string{}
		for _, a := range plan.Actions {
			suggest[a.Item] = fmt.Sprintf("recover to %s (run %d: Stripe's %s at %s)", a.To, plan.RunID, a.Evidence.EventName, a.Evidence.Hour.Format("2006-01-02 15:04"))
		}
		for i := range items {
			items[i].Suggestion = suggest[items[i].ID]
		}
	}
	c.render(w, r, "uncertain", "Uncertain and rejected", struct{ Items []doubtfulItem }{items})
}

func (c *Console) recover(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	if !ok {
		http.NotFound(w, r)
		return
	}
	_, err := reconcile.Recover(r.Context(), c.pool, c.Outbox, id, reconcile.Recovery{
		Expect: outbox.State(r.PostFormValue("expect")), To: outbox.State(r.PostFormValue("to")),
		Reason: r.PostFormValue("reason"), NotReached: r.PostFormValue("not_reached") != "", By: actor(r)})
	var se *reconcile.ExpectedStateError
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		http.NotFound(w, r)
	case err == nil:
		back(w, r, "/console/uncertain", "recovered")
	case errors.As(err, &se):
		back(w, r, "/console/uncertain", "expected_state")
	case errors.Is(err, reconcile.ErrInvalidRecovery):
		back(w, r, "/console/uncertain", "invalid_recovery")
	case errors.Is(err, outbox.ErrPastHorizon):
		back(w, r, "/console/uncertain", "past_horizon")
	default:
		c.fail(w, r, err)
	}
}

// ---- Mappings

type unmapped struct {
	Kind, Name string
	Events     int64
}

func (c *Console) mappingsPage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	fs, err := c.Mappings.Features(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ts, err := c.Mappings.Tenants(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	rows, err := c.pool.Query(ctx, `
		SELECT 'feature', feature, count(*) FROM usage_events e
		WHERE received_at > clock_timestamp() - interval '7 days' AND NOT EXISTS (SELECT 1 FROM feature_mappings m WHERE m.feature = e.feature)
		GROUP BY 2
		UNION ALL
		SELECT 'tenant', tenant, count(*) FROM usage_events e
		WHERE received_at > clock_timestamp() - interval '7 days' AND NOT EXISTS (SELECT 1 FROM tenant_mappings m WHERE m.tenant = e.tenant)
		GROUP BY 2
		ORDER BY 1, 2`)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	missing, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (unmapped, error) {
		var u unmapped
		err := row.Scan(&u.Kind, &u.Name, &u.Events)
		return u, err
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	all, err := audit.List(ctx, c.pool, "", 500)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var history []audit.Entry
	for _, e := range all {
		if e.Action == audit.ActionFeatureMapping || e.Action == audit.ActionTenantMapping {
			history = append(history, e)
		}
	}
	// A restricted key cannot use Stripe's v2 API: the stream is not
	// offered (PutFeature would refuse it).
	exporters := mappings.Exporters
	if c.Mappings.RestrictedKey {
		exporters = slices.DeleteFunc(slices.Clone(exporters), func(e string) bool { return e == mappings.ExporterStripeMeterEventStream })
	}
	c.render(w, r, "mappings", "Mappings", struct {
		Features      []mappings.Feature
		Tenants       []mappings.Tenant
		Unmapped      []unmapped
		History       []audit.Entry
		Exporters     []string
		RestrictedKey bool
	}{fs, ts, missing, history, exporters, c.Mappings.RestrictedKey})
}

func (c *Console) putFeature(w http.ResponseWriter, r *http.Request) {
	var window mappings.Duration
	if s := strings.TrimSpace(r.PostFormValue("window")); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			back(w, r, "/console/mappings", "invalid_mapping")
			return
		}
		window = mappings.Duration(d)
	}
	// The exporter select's first option (empty) is the node's default.
	in := mappings.FeatureInput{EventName: strings.TrimSpace(r.PostFormValue("event_name")),
		Aggregation: mappings.Aggregation(r.PostFormValue("aggregation")), Window: window,
		Exporter: r.PostFormValue("exporter")}
	_, _, err := c.Mappings.PutFeature(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("feature")), in, actor(r))
	c.mappingResult(w, r, err, "feature_saved")
}

func (c *Console) putTenant(w http.ResponseWriter, r *http.Request) {
	in := mappings.TenantInput{StripeCustomerID: strings.TrimSpace(r.PostFormValue("customer"))}
	_, _, err := c.Mappings.PutTenant(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("tenant")), in, actor(r))
	c.mappingResult(w, r, err, "tenant_saved")
}

func (c *Console) mappingResult(w http.ResponseWriter, r *http.Request, err error, ok string) {
	var (
		ve *mappings.ValidationError
		me *mappings.MeterError
		pu *mappings.ErrProviderUnavailable
	)
	switch {
	case err == nil:
		back(w, r, "/console/mappings", ok)
	case errors.As(err, &ve), errors.As(err, &me), errors.As(err, &pu):
		back(w, r, "/console/mappings", "invalid_mapping")
	default:
		c.fail(w, r, err)
	}
}

// ---- Reconciliation

func (c *Console) reconcilePage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	runs, err := reconcile.List(ctx, c.pool, 30)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	data := struct {
		Runs          []reconcile.Run
		Run           *reconcile.Run
		Discrepancies []reconcile.Discrepancy
		Plan          reconcile.Plan
		Settle        string
	}{Runs: runs, Settle: c.Settle.String()}
	if s := chi.URLParam(r, "id"); s != "" {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			http.NotFound(w, r)
			return
		}
		run, err := reconcile.Get(ctx, c.pool, id)
		if errors.Is(err, reconcile.ErrNotFound) {
			http.NotFound(w, r)
			return
		}
		if err != nil {
			c.fail(w, r, err)
			return
		}
		data.Run = &run
		if data.Discrepancies, err = reconcile.Discrepancies(ctx, c.pool, id); err != nil {
			c.fail(w, r, err)
			return
		}
		if data.Plan, err = reconcile.PlanOf(ctx, c.pool, c.Outbox, id); err != nil {
			c.fail(w, r, err)
			return
		}
	}
	c.render(w, r, "reconcile", "Reconciliation", data)
}

func (c *Console) startRun(w http.ResponseWriter, r *http.Request) {
	if c.Reconcile == nil {
		back(w, r, "/console/reconcile", "no_stripe")
		return
	}
	settle, err := time.ParseDuration(strings.TrimSpace(r.PostFormValue("settle")))
	if err != nil || settle < 0 {
		back(w, r, "/console/reconcile", "invalid_settle")
		return
	}
	err = pgx.BeginFunc(r.Context(), c.pool, func(tx pgx.Tx) error {
		id, err := reconcile.Queue(r.Context(), tx, reconcile.TriggerAPI, actor(r), reconcile.Options{Settle: settle})
		if err != nil {
			return err
		}
		return c.Reconcile(r.Context(), tx, id)
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	back(w, r, "/console/reconcile", "run_queued")
}

// ---- Completeness

func (c *Console) completeness(w http.ResponseWriter, r *http.Request) {
	period := r.URL.Query().Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		period = time.Now().UTC().Format("2006-01")
	}
	tenant := r.URL.Query().Get("tenant")
	rep, err := quarantine.CompletenessOf(r.Context(), c.pool, period, tenant)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "completeness", "Completeness", struct {
		Period, Tenant string
		Report         quarantine.Completeness
		Chart          template.HTML
	}{period, tenant, rep, completenessChart(rep)})
}
