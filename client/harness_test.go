package client_test

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/client"
	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// The helpers the client's tests share: a real Tally — the /v1 handler
// built as `tally serve` builds it, on a fresh PostgreSQL database of its
// own, served over HTTP — and a proxy in front of it that injects the
// failures a real Tally does not produce on demand (a lost reply, a 503, a
// 429 with an HTTP-date Retry-After, a request held).

// tally is a real Tally for one test.
type tally struct {
	t     *testing.T
	ctx   context.Context
	pool  *pgxpool.Pool
	url   string
	token string // an ingest token for every tenant
}

// newTally serves the API on a fresh database with the configuration the
// binary would read from env ("NAME=value"), and makes an ingest token.
func newTally(t *testing.T, env ...string) *tally {
	t.Helper()
	pool := testdb.New(t)
	vars := map[string]string{"TALLY_DATABASE_URL": testdb.URLOf(t, pool), "TALLY_LOG_LEVEL": "error"}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	fs := flag.NewFlagSet("tally-test", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return vars[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	parts, err := app.Build(cfg)
	require.NoError(t, err)
	logs := &syncbuf.Buffer{}
	handler := api.New(api.Options{Logger: slog.New(slog.NewTextHandler(logs, nil)), V1: &api.Deps{
		Pool: pool, Outbox: parts.Outbox, Mappings: parts.Mappings, Ingester: parts.Ingester,
		Requeuer: parts.Requeuer, Metrics: parts.API, Quota: cfg.Quota.Ingest,
	}})
	srv := httptest.NewServer(handler)
	t.Cleanup(func() {
		srv.Close()
		if t.Failed() {
			t.Logf("server log:\n%s", logs.String())
		}
	})
	tl := &tally{t: t, ctx: context.Background(), pool: pool, url: srv.URL}
	tl.token = tl.newToken(auth.TokenSpec{Name: "svc", Role: auth.RoleIngest})
	return tl
}

// newToken makes a token and returns its secret.
func (tl *tally) newToken(spec auth.TokenSpec) string {
	tl.t.Helper()
	spec.By = "test"
	tok, err := auth.Create(tl.ctx, tl.pool, spec)
	require.NoError(tl.t, err)
	return tok.Secret
}

// client is a client of url with tl's token, quick to retry, with opts.
func (tl *tally) client(url string, opts ...client.Option) *client.Client {
	tl.t.Helper()
	opts = append([]client.Option{client.WithBackoff(5*time.Millisecond, 50*time.Millisecond),
		client.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))}, opts...)
	c, err := client.New(url, tl.token, opts...)
	require.NoError(tl.t, err)
	return c
}

// row is a ledger row as the tests check it.
type row struct {
	Feature    string
	Value      int64
	OccurredAt time.Time
	Given      bool // timestamp_given: the event carried a timestamp
}

// ledger is every stored event, by tenant/id; a key stored twice fails the
// test.
func (tl *tally) ledger() map[string]row {
	tl.t.Helper()
	rows, err := tl.pool.Query(tl.ctx, `SELECT tenant || '/' || event_id, feature, value, occurred_at, timestamp_given FROM usage_events`)
	require.NoError(tl.t, err)
	out := map[string]row{}
	var (
		k string
		r row
	)
	_, err = pgx.ForEachRow(rows, []any{&k, &r.Feature, &r.Value, &r.OccurredAt, &r.Given}, func() error {
		_, twice := out[k]
		require.False(tl.t, twice, "event %s stored twice", k)
		out[k] = r
		return nil
	})
	require.NoError(tl.t, err)
	return out
}

// requireStored checks that the ledger holds exactly events, once each,
// with their content.
func (tl *tally) requireStored(events ...client.Event) {
	tl.t.Helper()
	got := tl.ledger()
	require.Len(tl.t, got, len(events), "the ledger holds exactly the events expected")
	for _, ev := range events {
		r, ok := got[ev.Tenant+"/"+ev.ID]
		require.True(tl.t, ok, "event %s/%s is stored", ev.Tenant, ev.ID)
		require.Equal(tl.t, ev.Feature, r.Feature, ev.ID)
		require.Equal(tl.t, ev.Value, r.Value, ev.ID)
		if !ev.Timestamp.IsZero() {
			require.True(tl.t, r.Given, "%s: stored with its timestamp", ev.ID)
			require.True(tl.t, ev.Timestamp.Truncate(time.Microsecond).Equal(r.OccurredAt), "%s: %s stored as %s", ev.ID, ev.Timestamp, r.OccurredAt)
		}
	}
}

// events are n events of tenant acme, feature api_calls, with ids
// prefix-0…, values 1…n and no timestamp.
func events(prefix string, n int) []client.Event {
	out := make([]client.Event, n)
	for i := range out {
		out[i] = client.Event{ID: fmt.Sprintf("%s-%d", prefix, i), Tenant: "acme", Feature: "api_calls", Value: int64(i + 1)}
	}
	return out
}

// ---------------------------------------------------------------------------
// The proxy: failure injection in front of a real Tally.

// action is what the proxy does with one request.
type action struct {
	// status, when set, is answered instead of forwarding the request,
	// with Retry-After when retryAfter is set.
	status     int
	retryAfter string
	// loseReply forwards the request, then cuts the connection without
	// answering: the server stored it, the client never learns so.
	loseReply bool
	// hold, when set, is waited on before the request is forwarded.
	hold <-chan struct{}
}

// proxy forwards POST /v1/usage to a real Tally, doing to each request
// what its plan says, and records what it received.
type proxy struct {
	upstream string
	url      string

	mu     sync.Mutex
	plan   func(n int) action // n counts requests from 1
	bodies [][]byte
	auth   []string
}

func newProxy(t *testing.T, upstream string, plan func(n int) action) *proxy {
	t.Helper()
	p := &proxy{upstream: upstream, plan: plan}
	srv := httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return p
}

// newTLSProxy is newProxy serving HTTPS with a certificate of its own, and
// an HTTP client that trusts it.
func newTLSProxy(t *testing.T, upstream string) (*proxy, *http.Client) {
	t.Helper()
	p := &proxy{upstream: upstream, plan: forward}
	srv := httptest.NewTLSServer(http.HandlerFunc(p.serve))
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return p, srv.Client()
}

// setPlan replaces the plan for the requests to come.
func (p *proxy) setPlan(plan func(n int) action) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.plan = plan
}

// requests is how many requests reached the proxy.
func (p *proxy) requests() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.bodies)
}

// authorizations are the Authorization headers of the requests, in order.
func (p *proxy) authorizations() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.auth)
}

// body is the n-th request's body (from 1).
func (p *proxy) body(n int) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.bodies[n-1]
}

func (p *proxy) serve(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	p.mu.Lock()
	p.bodies = append(p.bodies, b)
	p.auth = append(p.auth, r.Header.Get("Authorization"))
	a := p.plan(len(p.bodies))
	p.mu.Unlock()
	if a.status != 0 {
		if a.retryAfter != "" {
			w.Header().Set("Retry-After", a.retryAfter)
		}
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(a.status)
		_, _ = w.Write([]byte("<html>the proxy says no</html>"))
		return
	}
	if a.hold != nil {
		select {
		case <-a.hold:
		case <-r.Context().Done():
			return
		}
	}
	req, err := http.NewRequestWithContext(r.Context(), r.Method, p.upstream+r.URL.Path, bytes.NewReader(b))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	if a.loseReply {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
		return
	}
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// forward is the plan that forwards every request.
func forward(int) action { return action{} }

// logSink collects a client's log lines.
type logSink struct{ syncbuf.Buffer }

func (s *logSink) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(&s.Buffer, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// lines are the log's lines that contain s.
func (s *logSink) lines(sub string) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(s.String()))
	for sc.Scan() {
		if strings.Contains(sc.Text(), sub) {
			out = append(out, sc.Text())
		}
	}
	return out
}
