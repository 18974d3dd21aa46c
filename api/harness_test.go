package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/api/openapitest"
	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// The helpers every /v1 test shares: the harness, the runner of a
// scenario's steps, and the JSON views several tests decode.

// ---------------------------------------------------------------------------
// Harness: the /v1 handler built as `tally serve` builds it, on a fresh
// database, served over real HTTP.

// syncBuffer is a log sink safe for the server's goroutines: the harness
// shows its lines when a test fails.
type syncBuffer = syncbuf.Buffer

type harness struct {
	t       *testing.T
	ctx     context.Context
	pool    *pgxpool.Pool
	parts   *app.Parts
	handler http.Handler
	url     string
	client  *http.Client
}

// testTarget is the destination a node with a Stripe test key would stage
// for.
func testTarget(context.Context) (meter.Target, bool) {
	return meter.Target{Exporter: "stripe_meter_events", Account: "acct_1", Mode: outbox.ModeTest,
		AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute,
		// The tests date usage hours back, which in the first hours of a
		// month is in a period whose invoice closed an hour after it ended:
		// the longest grace keeps it from being late (late usage has its
		// own tests, which set both).
		InvoiceGrace: meter.MaxInvoiceGrace, LateUsage: meter.LateSend}, true
}

// newHarness builds the parts from a configuration read the way the binary
// reads it (no STRIPE_API_KEY: export stalled) and serves the API. With
// staging, the stager addresses items to testTarget instead.
func newHarness(t *testing.T, staging bool) *harness {
	t.Helper()
	return newHarnessWith(t, staging, nil)
}

// newHarnessWith is newHarness with more dependencies: with, when set,
// completes the API's before it is served.
func newHarnessWith(t *testing.T, staging bool, with func(*api.Deps)) *harness {
	t.Helper()
	pool := testdb.New(t)
	env := map[string]string{
		"TALLY_DATABASE_URL": testdb.URLOf(t, pool),
		"TALLY_LOG_LEVEL":    "error",
	}
	fs := flag.NewFlagSet("tally-test", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	parts, err := app.Build(cfg)
	require.NoError(t, err)
	if staging {
		parts.Stager.Target = testTarget
	}
	logs := &syncBuffer{}
	deps := &api.Deps{Pool: pool, Outbox: parts.Outbox, Mappings: parts.Mappings, Ingester: parts.Ingester,
		Requeuer: parts.Requeuer, Metrics: parts.API}
	if with != nil {
		with(deps)
	}
	handler := api.New(api.Options{Logger: slog.New(slog.NewTextHandler(logs, nil)), V1: deps})
	srv := httptest.NewServer(handler)
	t.Cleanup(func() {
		srv.Close()
		if t.Failed() {
			t.Logf("server log:\n%s", logs.String())
		}
	})
	return &harness{t: t, ctx: context.Background(), pool: pool, parts: parts, handler: handler,
		url: srv.URL, client: srv.Client()}
}

// token creates a live token directly in the database and returns its
// secret.
func (h *harness) token(name string, role auth.Role, tenants ...string) string {
	h.t.Helper()
	tok, err := auth.CreateToken(h.ctx, h.pool, name, role, tenants)
	require.NoError(h.t, err)
	return tok.Secret
}

// correctingToken is token for a token that may also post corrections
// (negative values).
func (h *harness) correctingToken(name string, role auth.Role, tenants ...string) string {
	h.t.Helper()
	tok, err := auth.Create(h.ctx, h.pool, auth.TokenSpec{Name: name, Role: role, Tenants: tenants, Corrections: true, By: "test"})
	require.NoError(h.t, err)
	return tok.Secret
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) String() string { return fmt.Sprintf("%d %s", r.status, r.body) }

// errorShape is the error shape, decoded strictly: {"error":{"code","message"}}
// and, for 422, "problems".
type errorShape struct {
	Error struct {
		Code     string            `json:"code"`
		Message  string            `json:"message"`
		Problems []json.RawMessage `json:"problems"`
	} `json:"error"`
}

func (r response) errorCode(t *testing.T) string {
	t.Helper()
	var top map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(r.body, &top), "%s", r)
	require.Len(t, top, 1, "the error shape has one key, error: %s", r)
	var e errorShape
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&e), "%s", r)
	require.NotEmpty(t, e.Error.Code, "%s", r)
	require.NotEmpty(t, e.Error.Message, "%s", r)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	return e.Error.Code
}

type problem struct {
	Index  *int   `json:"index"`
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

func (r response) problems(t *testing.T) []problem {
	t.Helper()
	var e struct {
		Error struct {
			Problems []problem `json:"problems"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(r.body, &e), "%s", r)
	return e.Error.Problems
}

func (r response) decode(t *testing.T, v any) {
	t.Helper()
	require.NoError(t, json.Unmarshal(r.body, v), "%s", r)
}

// request sends one request and fails the test on a 500. body is sent as is
// when it is a string or []byte, as JSON otherwise; nil sends none.
func (h *harness) request(method, path, authorization string, body any) response {
	h.t.Helper()
	resp := h.try(method, path, authorization, body)
	require.NotEqual(h.t, http.StatusInternalServerError, resp.status, "%s %s: %s", method, path, resp.body)
	return resp
}

// try is request without the check for a 500.
func (h *harness) try(method, path, authorization string, body any) response {
	h.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		require.NoError(h.t, err)
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequestWithContext(h.ctx, method, h.url+path, rd)
	require.NoError(h.t, err)
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	return h.do(req)
}

func (h *harness) send(req *http.Request) response {
	h.t.Helper()
	resp := h.do(req)
	require.NotEqual(h.t, http.StatusInternalServerError, resp.status, "%s %s: %s", req.Method, req.URL.Path, resp.body)
	return resp
}

// do sends req and reads the answer. Every exchange with /v1 is checked
// against the OpenAPI document (api/openapi.json): an answer it does not
// describe, or a request the server took that it refuses, fails the test
// (openapitest.Checker.Check says which and why).
func (h *harness) do(req *http.Request) response {
	h.t.Helper()
	var sent []byte
	if req.Body != nil {
		var err error
		sent, err = io.ReadAll(req.Body)
		require.NoError(h.t, err)
		_ = req.Body.Close()
		req.Body = io.NopCloser(bytes.NewReader(sent))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(sent)), nil }
	}
	resp, err := h.client.Do(req)
	require.NoError(h.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(h.t, err)
	checkOpenAPI(h.t, req, sent, resp, b)
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

// checkOpenAPI fails t when the exchange does not match the OpenAPI
// document. It may be called from any goroutine.
func checkOpenAPI(t testing.TB, req *http.Request, sent []byte, resp *http.Response, body []byte) {
	t.Helper()
	c, err := openapitest.Default()
	if err != nil {
		t.Errorf("reading the OpenAPI document: %v", err)
		return
	}
	if err := c.Check(req, sent, resp, body); err != nil {
		t.Errorf("%v", err)
	}
}

// in is the harness for the subtest t: its checks fail t, not the test
// that built the harness (FailNow must be called from t's own goroutine).
func (h *harness) in(t *testing.T) *harness {
	c := *h
	c.t = t
	return &c
}

func (h *harness) as(secret string) string { return "Bearer " + secret }

func (h *harness) count(sql string, args ...any) int64 {
	h.t.Helper()
	var n int64
	require.NoError(h.t, h.pool.QueryRow(h.ctx, sql, args...).Scan(&n))
	return n
}

func (h *harness) pass() meter.PassResult {
	h.t.Helper()
	res, err := h.parts.Stager.Pass(h.ctx, h.pool)
	require.NoError(h.t, err)
	return res
}

// event is one usage event as posted.
type event map[string]any

func batch(events ...event) map[string]any { return map[string]any{"events": events} }

func rfc(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// ---------------------------------------------------------------------------
// Scenarios: named steps over one database.

// step is one named step of a scenario test. run gets the step's own t and
// the scenario's harness bound to it.
type step struct {
	name string
	run  func(t *testing.T, h *harness)
}

// runSteps runs a scenario's steps as subtests of t, in order, on h's
// database, and stops at the first that fails. Each step reads the state the
// ones before it left (rows, versions, the scenario's fields), so a step
// never calls t.Parallel.
func runSteps(t *testing.T, h *harness, steps ...step) {
	t.Helper()
	for _, s := range steps {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, h.in(t)) }) {
			t.FailNow()
		}
	}
}

// ---------------------------------------------------------------------------
// Views: the JSON the API answers, as several tests decode it.

// featureView is a feature mapping as PUT and GET show it.
type featureView struct {
	Feature            string        `json:"feature"`
	EventName          string        `json:"event_name"`
	Aggregation        string        `json:"aggregation"`
	Window             string        `json:"window"`
	Exporter           *string       `json:"exporter"`
	CustomerPayloadKey *string       `json:"customer_payload_key"`
	ValuePayloadKey    *string       `json:"value_payload_key"`
	MappingVersion     int           `json:"mapping_version"`
	UpdatedBy          string        `json:"updated_by"`
	Changed            *bool         `json:"changed"`
	History            []featureView `json:"history"`
}

// tenantView is a tenant mapping as PUT and GET show it.
type tenantView struct {
	Tenant           string       `json:"tenant"`
	StripeCustomerID string       `json:"stripe_customer_id"`
	PeriodAnchor     *time.Time   `json:"period_anchor"`
	MappingVersion   int          `json:"mapping_version"`
	Changed          *bool        `json:"changed"`
	History          []tenantView `json:"history"`
}

// ItemView is an outbox item as /v1/outbox/items shows it.
type ItemView struct {
	ID             int64          `json:"id"`
	Tenant         string         `json:"tenant"`
	SubjectKind    string         `json:"subject_kind"`
	SubjectRef     string         `json:"subject_ref"`
	Exporter       string         `json:"exporter"`
	MappingVersion int            `json:"mapping_version"`
	Identifier     string         `json:"identifier"`
	Payload        outbox.Payload `json:"payload"`
	State          string         `json:"state"`
	Reason         string         `json:"quarantine_reason"`
	SupersededBy   *int64         `json:"superseded_by"`
}

// bucket is one column of a completeness line: events and their value.
type bucket struct {
	Events int64 `json:"events"`
	Value  int64 `json:"value"`
}

// completenessLine is one tenant, feature and period of the report.
type completenessLine struct {
	Tenant            string   `json:"tenant"`
	Feature           string   `json:"feature"`
	Period            string   `json:"period"`
	Accounts          []string `json:"destination_accounts"`
	Ingested          bucket   `json:"ingested"`
	Confirmed         bucket   `json:"confirmed"`
	Accepted          bucket   `json:"accepted"`
	Pending           bucket   `json:"pending"`
	Quarantined       bucket   `json:"quarantined"`
	Uncertain         bucket   `json:"uncertain"`
	Rejected          bucket   `json:"rejected"`
	Cancelled         bucket   `json:"cancelled"`
	Unstaged          bucket   `json:"unstaged"`
	PeriodClosed      bucket   `json:"period_closed"`
	InconsistentItems int64    `json:"inconsistent_items"`
	Discrepancies     int64    `json:"discrepancies"`
	StripeHasMore     int64    `json:"discrepancies_stripe_has_more"`
	Invoiced          *int64   `json:"invoiced"`
	Invoice           string   `json:"invoice"`
	InvoiceKinds      []string `json:"invoice_discrepancies"`
	Customer          string   `json:"customer"`
	Price             string   `json:"price"`
	Currency          string   `json:"currency"`
	Amount            *int64   `json:"amount"`
	AmountAtRisk      *int64   `json:"amount_at_risk"`
	AmountNote        string   `json:"amount_note"`
	Holds             bool     `json:"holds"`
}

// amount is one currency's total of the report's priced lines.
type amount struct {
	Customer string `json:"customer"`
	Currency string `json:"currency"`
	Amount   int64  `json:"amount"`
	AtRisk   int64  `json:"at_risk"`
	Lines    int    `json:"lines"`
}

// completenessReport is GET /v1/reports/completeness.
type completenessReport struct {
	Period       string             `json:"period"`
	Lines        []completenessLine `json:"lines"`
	ReconcileRun *int64             `json:"reconcile_run"`
	Holds        bool               `json:"holds"`
	AsOf         string             `json:"as_of"`
	Amounts      []amount           `json:"amounts"`
	Customers    []amount           `json:"customers"`
	Unpriced     int                `json:"unpriced_lines"`
}

// completeness reads the report for query (a period, then any other
// parameters), decoded strictly.
func completeness(t *testing.T, h *harness, token, query string) completenessReport {
	t.Helper()
	resp := h.request(http.MethodGet, "/v1/reports/completeness?period="+query, token, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var c completenessReport
	dec := json.NewDecoder(bytes.NewReader(resp.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&c), "%s", resp)
	_, err := time.Parse(time.RFC3339Nano, c.AsOf)
	require.NoError(t, err, "as_of is when the report's snapshot was taken: %s", resp)
	return c
}
