package stripesim_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// lastResponse is a transport that remembers the last response's status
// and headers: stripe-go's errors of /v2 paths carry neither.
type lastResponse struct {
	mu     sync.Mutex
	status int
	header http.Header
	next   http.RoundTripper
}

func (l *lastResponse) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := l.next.RoundTrip(req)
	if err == nil {
		l.mu.Lock()
		l.status, l.header = res.StatusCode, res.Header.Clone()
		l.mu.Unlock()
	}
	return res, err
}

func (l *lastResponse) get() (int, http.Header) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.status, l.header
}

// streamClient is stripe-go as an exporter of the stream builds it: the
// session token as key, every backend (MeterEvents among them) at the
// simulator, no retries; its transport records the last response.
func streamClient(ts *httptest.Server, token string) (*stripe.Client, *lastResponse) {
	rec := &lastResponse{next: ts.Client().Transport}
	sc := stripe.NewClient(token, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(ts.URL),
		HTTPClient:        &http.Client{Transport: rec},
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
		EnableTelemetry:   stripe.Bool(false),
	})))
	return sc, rec
}

// newSession creates a meter event session with the test key (the
// Stripe-Account header when account is set) and returns its token.
func newSession(t testing.TB, ts *httptest.Server, account string) string {
	t.Helper()
	p := &stripe.V2BillingMeterEventSessionCreateParams{}
	if account != "" {
		p.SetStripeAccount(account)
	}
	sess, err := client(ts, testKey).V2BillingMeterEventSessions.Create(context.Background(), p)
	require.NoError(t, err)
	return sess.AuthenticationToken
}

// validEvents is n valid api_calls events of cus_acme, value 1, with the
// identifiers prefix-0 … prefix-(n-1).
func validEvents(prefix string, n int) []*stripe.V2BillingMeterEventStreamCreateEventParams {
	out := make([]*stripe.V2BillingMeterEventStreamCreateEventParams, n)
	for i := range out {
		out[i] = streamEvent("api_calls", "cus_acme", fmt.Sprint(prefix, "-", i), "1", base.Add(-time.Hour))
	}
	return out
}

func streamParams(evs ...*stripe.V2BillingMeterEventStreamCreateEventParams) *stripe.V2BillingMeterEventStreamCreateParams {
	return &stripe.V2BillingMeterEventStreamCreateParams{Events: evs}
}

// v2Raw returns err as stripe-go's catch-all error of /v2 paths.
func v2Raw(t *testing.T, err error) *stripe.V2RawError {
	t.Helper()
	var raw *stripe.V2RawError
	require.ErrorAs(t, err, &raw)
	var se *stripe.Error
	assert.False(t, errors.As(err, &se), "stripe-go v82 never answers a *stripe.Error on /v2")
	return raw
}

type reportSummary struct {
	eventName, code string
	idents          []string
}

func reportsOf(sim *stripesim.Server, account string) []reportSummary {
	var out []reportSummary
	for _, r := range sim.ErrorReports(account) {
		out = append(out, reportSummary{r.EventName, r.Code, r.Identifiers})
	}
	return out
}

func statusesOf(evs []stripesim.RecordedEvent) map[string]string {
	out := map[string]string{}
	for _, ev := range evs {
		out[ev.Identifier] = ev.Status
	}
	return out
}

// streamFaultCase is a fault TestStreamFaults applies to one stream
// request, and what comes of it.
type streamFaultCase struct {
	name          string
	faults        stripesim.Faults
	status        int
	errType       string // "" for success
	errCode       string
	events        map[string]string // identifier -> status
	reports       []reportSummary
	atLeast       time.Duration
	replayOnRetry bool
}

func TestStreamFaults(t *testing.T) {
	t.Parallel()
	// Every request: three valid events, one for a meter that does not
	// exist, and a duplicate inside the request.
	events := append(validEvents("f", 3),
		streamEvent("nope", "cus_acme", "f-nope", "1", base),
		streamEvent("api_calls", "cus_acme", "f-0", "1", base.Add(-time.Hour)))
	noMeter := reportSummary{"nope", stripesim.CodeNoMeter, []string{"f-nope"}}
	dropped := reportSummary{"api_calls", stripesim.CodeDropped, []string{"f-0", "f-1", "f-2"}}
	recorded := map[string]string{"f-0": stripesim.EventRecorded, "f-1": stripesim.EventRecorded, "f-2": stripesim.EventRecorded}

	cases := []streamFaultCase{
		{name: "RateLimitFault", faults: stripesim.Faults{RateLimitFault: 1},
			status: http.StatusTooManyRequests, errType: "invalid_request_error", errCode: "rate_limit", events: map[string]string{}},
		{name: "FailBeforeRecord", faults: stripesim.Faults{FailBeforeRecord: 1},
			status: http.StatusInternalServerError, errType: "api_error", events: map[string]string{}},
		{name: "LoseReply", faults: stripesim.Faults{LoseReply: 1},
			status: http.StatusBadGateway, errType: "api_error", events: recorded, reports: []reportSummary{noMeter}, replayOnRetry: true},
		{name: "AsyncDrop", faults: stripesim.Faults{AsyncDrop: 1}, status: http.StatusOK,
			events:  map[string]string{"f-0": stripesim.EventDropped, "f-1": stripesim.EventDropped, "f-2": stripesim.EventDropped},
			reports: []reportSummary{dropped, noMeter}},
		{name: "LatencyAndJitter", faults: stripesim.Faults{Latency: 100 * time.Millisecond, LatencyJitter: 20 * time.Millisecond},
			status: http.StatusOK, events: recorded, reports: []reportSummary{noMeter}, atLeast: 100 * time.Millisecond},
		{name: "ReadFaultIsGETOnly", faults: stripesim.Faults{ReadFault: 1},
			status: http.StatusOK, events: recorded, reports: []reportSummary{noMeter}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.check(t, events)
		})
	}
	t.Run("Hang", func(t *testing.T) {
		t.Parallel()
		streamHang(t, events)
	})
	t.Run("AsyncDropPerEvent", func(t *testing.T) {
		t.Parallel()
		streamAsyncDropPerEvent(t)
	})
}

// check sends events in one stream request under the case's faults and
// checks the answer, the recorded events and the error reports, and, when
// the reply was lost, the replay of a retry.
func (tc streamFaultCase) check(t *testing.T, events []*stripe.V2BillingMeterEventStreamCreateEventParams) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: tc.faults})
	sc, rec := streamClient(ts, newSession(t, ts, ""))
	p := streamParams(events...)
	p.SetIdempotencyKey("stream-req-1")

	start := time.Now()
	err := sc.V2BillingMeterEventStreams.Create(context.Background(), p)
	status, header := rec.get()
	assert.Equal(t, tc.status, status)
	assert.GreaterOrEqual(t, time.Since(start), tc.atLeast)
	if tc.errType == "" {
		require.NoError(t, err)
	} else {
		raw := v2Raw(t, err)
		require.NotNil(t, raw.Type)
		assert.Equal(t, tc.errType, string(*raw.Type))
		assert.Equal(t, tc.errCode, raw.Code)
		assert.Regexp(t, `^req_`, header.Get("Request-Id"))
	}
	assert.Equal(t, tc.events, statusesOf(sim.Events(acct)))
	assert.Equal(t, tc.reports, reportsOf(sim, acct))
	if tc.replayOnRetry {
		// The retry with the same key gets the kept 200; nothing is
		// recorded or reported again.
		sim.Configure(acct, stripesim.Limits{})
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), p))
		status, header := rec.get()
		assert.Equal(t, http.StatusOK, status)
		assert.Equal(t, "true", header.Get("Idempotent-Replayed"))
		assert.Equal(t, tc.events, statusesOf(sim.Events(acct)))
		assert.Equal(t, tc.reports, reportsOf(sim, acct))
		assert.Empty(t, sim.RecordedTwice())
	}
}

// streamHang checks the Hang fault on a stream request of events: never
// answered until the client gives up or the simulator closes.
func streamHang(t *testing.T, events []*stripe.V2BillingMeterEventStreamCreateEventParams) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Hang: 1}})
	sc, _ := streamClient(ts, newSession(t, ts, ""))
	// The clock starts before the deadline's: the call ends after the
	// deadline, so at least 150 ms after start (taken after the context, it
	// could read 149.7 ms on a loaded machine).
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	err := sc.V2BillingMeterEventStreams.Create(ctx, streamParams(events...))
	require.Error(t, err)
	assert.True(t, errors.Is(err, context.DeadlineExceeded), "%v", err)
	assert.GreaterOrEqual(t, time.Since(start), 150*time.Millisecond)

	// Close releases a request whose client would wait for ever.
	done := make(chan error, 1)
	go func() { done <- sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(events...)) }()
	time.Sleep(50 * time.Millisecond)
	select {
	case <-done:
		t.Fatal("answered while hanging")
	default:
	}
	sim.Close()
	assert.Equal(t, "api_error", string(*v2Raw(t, <-done).Type))
	assert.Empty(t, sim.Events(acct))
	assert.Empty(t, sim.ErrorReports(acct))
}

// streamAsyncDropPerEvent checks that the AsyncDrop fault draws each valid
// event of a stream request on its own, from the seeded source: the same
// seed drops the same events.
func streamAsyncDropPerEvent(t *testing.T) {
	var runs [2]map[string]string
	for i := range runs {
		sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{AsyncDrop: 0.5}})
		sc, _ := streamClient(ts, newSession(t, ts, ""))
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents("d", 100)...)))
		runs[i] = statusesOf(sim.Events(acct))
		var drops []string
		for j := range 100 {
			if id := fmt.Sprint("d-", j); runs[i][id] == stripesim.EventDropped {
				drops = append(drops, id)
			}
		}
		assert.Greater(t, len(drops), 20)
		assert.Less(t, len(drops), 80)
		reps := sim.ErrorReports(acct)
		require.Len(t, reps, 1, "one report per meter and code")
		assert.Equal(t, stripesim.CodeDropped, reps[0].Code)
		assert.Equal(t, sim.Meters(acct)[0].ID, reps[0].Meter)
		assert.Equal(t, drops, reps[0].Identifiers)
		assert.Equal(t, len(drops), reps[0].ErrorCount)
		_, count, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
		assert.Equal(t, 100-len(drops), count)
	}
	assert.Equal(t, runs[0], runs[1])
}

// TestStreamDrawsLikeV1 checks that a stream request draws its faults from
// the seeded source in the same order as a v1 call: the same seed gives
// the same sequence of outcomes.
func TestStreamDrawsLikeV1(t *testing.T) {
	t.Parallel()
	lim := stripesim.Limits{Faults: stripesim.Faults{RateLimitFault: 0.2, FailBeforeRecord: 0.3, LoseReply: 0.3, LatencyJitter: time.Millisecond}}
	const n = 40

	simV1, ts, _ := newMeterSim(t, lim)
	var v1 []int
	for i := range n {
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", fmt.Sprint("v1-", i), "1", base), nil)
		v1 = append(v1, r.status)
	}

	sim, ts, _ := newMeterSim(t, lim)
	tok := newSession(t, ts, "")
	var v2 []int
	for i := range n {
		r := doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents(fmt.Sprint("v2-", i), 1)})
		v2 = append(v2, r.status)
	}
	assert.Equal(t, v1, v2)
	for _, want := range []int{200, 429, 500, 502} {
		assert.Contains(t, v2, want)
	}
	// A lost reply (502) hides whether the call failed before recording:
	// the proxy loses Stripe's 500 as well as its 200.
	recorded := len(sim.Events(acct))
	assert.Equal(t, len(simV1.Events(acct)), recorded)
	assert.GreaterOrEqual(t, recorded, countOf(v2, 200))
	assert.LessOrEqual(t, recorded, countOf(v2, 200)+countOf(v2, 502))
}

func TestStreamHasNoPerCustomerMeterRule(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{
		OneCallPerCustomerMeter: true,
		Faults:                  stripesim.Faults{Latency: 200 * time.Millisecond},
	})
	tok := newSession(t, ts, "")
	statuses := make([]int, 5)
	var wg sync.WaitGroup
	for i := range statuses {
		wg.Go(func() {
			r := doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents(fmt.Sprint("c", i), 10)})
			statuses[i] = r.status
		})
	}
	wg.Wait()
	assert.Equal(t, []int{200, 200, 200, 200, 200}, statuses, "concurrent requests for one customer and meter all pass")
	assert.Zero(t, sim.MaxConcurrentPerKey(), "stream requests are not v1 calls in flight")
	assert.Len(t, sim.Events(acct), 50)
}

func TestStreamRateLimit(t *testing.T) {
	t.Parallel()

	t.Run("InvalidLimitsPanic", func(t *testing.T) {
		t.Parallel()
		sim := stripesim.New(stripesim.Options{})
		for _, lim := range []stripesim.Limits{
			{StreamRatePerSecond: -1},
			{StreamRatePerSecond: math.NaN()},
			{StreamBurst: -1},
		} {
			assert.Panics(t, func() { sim.Configure(acct, lim) }, "%+v", lim)
			assert.Panics(t, func() { sim.ConfigureDefault(lim) }, "%+v", lim)
		}
	})

	t.Run("SeparateBuckets", func(t *testing.T) {
		t.Parallel()
		// Slow refills (one token per 2 s), a v1 bucket of 1 and a stream
		// bucket of 2: each kind only ever takes its own tokens.
		_, ts, _ := newMeterSim(t, stripesim.Limits{RatePerSecond: 0.5, StreamRatePerSecond: 0.5, StreamBurst: 2})
		tok := newSession(t, ts, "")
		stream := func(id string) response {
			return doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents(id, 1)})
		}
		v1 := func(id string) response {
			return do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", id, "1", base), nil)
		}
		steps := []struct {
			name string
			send func(string) response
			want int
		}{
			{"stream takes its first token", stream, 200},
			{"v1 takes its only token", v1, 200},
			{"v1 has none left", v1, 429},
			{"stream still has its second", stream, 200},
			{"stream has none left", stream, 429},
			{"v1 still has none", v1, 429},
		}
		for i, st := range steps {
			r := st.send(fmt.Sprint("sep-", i))
			assert.Equal(t, st.want, r.status, st.name)
			if st.want == 429 {
				assert.Equal(t, "rate_limit", r.errField("code"), st.name)
				assert.Equal(t, "invalid_request_error", r.errField("type"), st.name)
			}
		}
		// Creating a session is an ordinary call: no bucket.
		for range 3 {
			newSession(t, ts, "")
		}
	})

	t.Run("Burst", func(t *testing.T) {
		t.Parallel()
		sim, ts, _ := newMeterSim(t, stripesim.Limits{StreamRatePerSecond: 5})
		tok := newSession(t, ts, "")
		statuses := make([]int, 20)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range statuses {
			wg.Go(func() {
				<-start
				statuses[i] = doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents(fmt.Sprint("b", i), 2)}).status
			})
		}
		close(start)
		wg.Wait()
		ok, limited := countOf(statuses, 200), countOf(statuses, 429)
		assert.Equal(t, 20, ok+limited, "%v", statuses)
		assert.GreaterOrEqual(t, ok, 5)
		assert.LessOrEqual(t, ok, 6, "a bucket of 5 and a trickle of 5/s")
		assert.Len(t, sim.Events(acct), 2*ok, "a limited request processes nothing")

		// The bucket refills on the real clock; v1 is not limited.
		time.Sleep(450 * time.Millisecond)
		assert.Equal(t, 200, doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents("later", 1)}).status)
		for i := range 10 {
			r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", fmt.Sprint("v1-", i), "1", base), nil)
			assert.Equal(t, 200, r.status)
		}
	})
}

func TestExpireSessions(t *testing.T) {
	t.Parallel()

	t.Run("Hook", func(t *testing.T) {
		t.Parallel()
		sim, ts, _ := newMeterSim(t, stripesim.Limits{})
		sim.AddAccount("acct_conn")
		sim.CreateMeter("acct_conn", stripesim.MeterSpec{EventName: "api_calls"})
		sim.CreateCustomer("acct_conn", "cus_acme")
		a1, a2, other := newSession(t, ts, ""), newSession(t, ts, ""), newSession(t, ts, "acct_conn")

		assert.Equal(t, 0, sim.ExpireSessions("acct_unknown"))
		assert.Equal(t, 2, sim.ExpireSessions(acct))
		assert.Equal(t, 0, sim.ExpireSessions(acct), "nothing live is left")
		for _, tok := range []string{a1, a2} {
			sc, rec := streamClient(ts, tok)
			err := sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents(tok[len(tok)-6:], 1)...))
			var expired *stripe.TemporarySessionExpiredError
			require.ErrorAs(t, err, &expired)
			assert.Equal(t, "billing_meter_event_session_expired", expired.Code)
			assert.Equal(t, stripe.ErrorType("temporary_session_expired"), expired.Type)
			assert.Equal(t, http.StatusUnauthorized, expired.LastResponse.StatusCode)
			status, _ := rec.get()
			assert.Equal(t, http.StatusUnauthorized, status)
		}
		assert.Empty(t, sim.Events(acct))

		// Another account's session lives on; a new session works.
		sc, _ := streamClient(ts, other)
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents("o", 1)...)))
		sc, _ = streamClient(ts, newSession(t, ts, ""))
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents("n", 1)...)))
		assert.Len(t, sim.Events(acct), 1)
		assert.Len(t, sim.Events("acct_conn"), 1)
	})

	t.Run("Clock", func(t *testing.T) {
		t.Parallel()
		cases := []struct {
			after   time.Duration
			expired bool
		}{
			{14*time.Minute + 59*time.Second, false},
			{15 * time.Minute, true},
			{16 * time.Minute, true},
		}
		for _, tc := range cases {
			sim, ts, clk := newMeterSim(t, stripesim.Limits{})
			tok := newSession(t, ts, "")
			clk.Add(tc.after)
			r := doJSON(t, ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents("k", 1)})
			if tc.expired {
				assert.Equal(t, http.StatusUnauthorized, r.status, "%v", tc.after)
				assert.Equal(t, "temporary_session_expired", r.errField("type"))
				assert.Equal(t, "billing_meter_event_session_expired", r.errField("code"))
				assert.Equal(t, 0, sim.ExpireSessions(acct), "already expired: not counted")
			} else {
				assert.Equal(t, http.StatusOK, r.status, "%v", tc.after)
				assert.Equal(t, 1, sim.ExpireSessions(acct))
			}
		}
	})
}

// TestStreamErrorsInStripeGo pins how stripe-go v82 surfaces each answer
// of the stream: it parses /v2 errors by error.type, so the expired
// session is a *stripe.TemporarySessionExpiredError and every other error
// a *stripe.V2RawError without HTTP status (the transport sees it).
func TestStreamErrorsInStripeGo(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		limits  stripesim.Limits
		token   func(sim *stripesim.Server, tok string) string
		events  int
		status  int
		errType string // "" for success
		errCode string
	}{
		{name: "unknown token", token: func(*stripesim.Server, string) string { return "mesk_test_nope" }, events: 1,
			status: 401, errType: "temporary_session_expired", errCode: "billing_meter_event_session_expired"},
		{name: "API key instead of a token", token: func(*stripesim.Server, string) string { return testKey }, events: 1,
			status: 401, errType: "temporary_session_expired", errCode: "billing_meter_event_session_expired"},
		{name: "expired session", token: func(sim *stripesim.Server, tok string) string { sim.ExpireSessions(acct); return tok }, events: 1,
			status: 401, errType: "temporary_session_expired", errCode: "billing_meter_event_session_expired"},
		{name: "no events", events: 0, status: 400, errType: "invalid_request_error", errCode: "parameter_missing"},
		{name: "101 events", events: 101, status: 400, errType: "invalid_request_error"},
		{name: "rate limit", limits: stripesim.Limits{StreamRatePerSecond: 0.001, StreamBurst: 1}, events: 1,
			status: 429, errType: "invalid_request_error", errCode: "rate_limit"},
		{name: "fail before record", limits: stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}}, events: 1,
			status: 500, errType: "api_error"},
		{name: "fail after record", limits: stripesim.Limits{Faults: stripesim.Faults{FailAfterRecord: 1}}, events: 1,
			status: 500, errType: "api_error"},
		{name: "lost reply", limits: stripesim.Limits{Faults: stripesim.Faults{LoseReply: 1}}, events: 1,
			status: 502, errType: "api_error"},
		{name: "success", events: 100, status: 200},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newMeterSim(t, tc.limits)
			tok := newSession(t, ts, "")
			if tc.token != nil {
				tok = tc.token(sim, tok)
			}
			sc, rec := streamClient(ts, tok)
			if tc.status == 429 { // take the only token first
				require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents("first", 1)...)))
			}
			err := sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(validEvents("e", tc.events)...))
			status, _ := rec.get()
			assert.Equal(t, tc.status, status)
			switch tc.errType {
			case "":
				require.NoError(t, err)
			case "temporary_session_expired":
				var expired *stripe.TemporarySessionExpiredError
				require.ErrorAs(t, err, &expired)
				assert.Equal(t, tc.errCode, expired.Code)
				assert.Equal(t, tc.status, expired.LastResponse.StatusCode)
				assert.NotEmpty(t, expired.Message)
			default:
				raw := v2Raw(t, err)
				require.NotNil(t, raw.Type)
				assert.Equal(t, tc.errType, string(*raw.Type))
				assert.Equal(t, tc.errCode, raw.Code)
				assert.NotEmpty(t, raw.Message)
			}
		})
	}
}

// streamBody is one stream request of n valid events with unique
// identifiers, as raw JSON.
func streamBody(buf *bytes.Buffer, prefix string, n int, at string) []byte {
	buf.Reset()
	buf.WriteString(`{"events":[`)
	for i := range n {
		if i > 0 {
			buf.WriteByte(',')
		}
		buf.WriteString(`{"event_name":"api_calls","identifier":"`)
		buf.WriteString(prefix)
		buf.WriteByte('-')
		buf.WriteString(strconv.Itoa(i))
		buf.WriteString(`","timestamp":"`)
		buf.WriteString(at)
		buf.WriteString(`","payload":{"stripe_customer_id":"cus_acme","value":"1"}}`)
	}
	buf.WriteString(`]}`)
	return buf.Bytes()
}

// BenchmarkStream posts 100-event stream requests from parallel clients
// over HTTP and reports the events recorded per second.
func BenchmarkStream(b *testing.B) {
	sim, ts, _ := newMeterSim(b, stripesim.Limits{})
	tok := newSession(b, ts, "")
	at := base.Add(-time.Hour).Format(time.RFC3339)
	hc := ts.Client()
	hc.Transport.(*http.Transport).MaxIdleConnsPerHost = 64
	var seq atomic.Int64
	const perRequest = 100

	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var buf bytes.Buffer
		for pb.Next() {
			body := streamBody(&buf, "bench-"+strconv.FormatInt(seq.Add(1), 10), perRequest, at)
			req, err := http.NewRequest(http.MethodPost, ts.URL+"/v2/billing/meter_event_stream", bytes.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer "+tok)
			res, err := hc.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			_ = res.Body.Close()
			if res.StatusCode != http.StatusOK {
				b.Errorf("status %d", res.StatusCode)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N*perRequest)/b.Elapsed().Seconds(), "events/s")
	if got := len(sim.Events(acct)); got != b.N*perRequest {
		b.Fatalf("recorded %d events, want %d", got, b.N*perRequest)
	}
}
