package client_test

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/client"
	"github.com/tallymeter/tally/internal/auth"
)

const secretToken = "tally-secret-token-never-printed"

func TestNewReportsEveryProblemAtOnce(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		baseURL string
		token   string
		opts    []client.Option
		want    []string
	}{
		{"no scheme", "tally.internal", secretToken, nil, []string{"http or https"}},
		{"no host", "http://", secretToken, nil, []string{"no host"}},
		{"credentials in the URL", "https://user:pw@tally.internal", secretToken, nil, []string{"must not carry credentials"}},
		{"a query", "https://tally.internal/?a=b", secretToken, nil, []string{"query"}},
		{"no token", "https://tally.internal", "", nil, []string{"token is empty"}},
		{"a token with a space", "https://tally.internal", "abc def", nil, []string{"printable ASCII without spaces"}},
		{"a batch larger than a request", "https://tally.internal", secretToken,
			[]client.Option{client.WithRequestLimits(100, 1<<20), client.WithBatchSize(101)}, []string{"batch size must be 1 to a request's events (100)"}},
		{"request limits above the server's", "https://tally.internal", secretToken,
			[]client.Option{client.WithRequestLimits(20_000, 6<<20)}, []string{"request's events must be 1 to 10000", "request's bytes must be"}},
		{"a buffer smaller than a batch", "https://tally.internal", secretToken,
			[]client.Option{client.WithBatchSize(500), client.WithBufferSize(100), client.WithBatchBytes(1 << 20), client.WithBufferBytes(1 << 10)},
			[]string{"buffer (100 events) must hold at least a batch (500 events)", "buffer (1024 bytes) must hold at least a batch"}},
		{"a bad interval, budget, backoff and HTTP client", "https://tally.internal", secretToken,
			[]client.Option{client.WithFlushInterval(0), client.WithRetryBudget(-time.Second), client.WithBackoff(time.Second, time.Millisecond),
				client.WithHTTPClient(nil)},
			[]string{"flush interval must be positive", "retry budget must not be negative", "backoff must be positive", "HTTP client is nil"}},
		{"everything at once", "ftp://x", "a b", []client.Option{client.WithBatchSize(0)},
			[]string{"http or https", "printable ASCII", "batch size must be"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := client.New(tc.baseURL, tc.token, tc.opts...)
			require.Error(t, err)
			require.Nil(t, c)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), secretToken, "the token is never in an error")
			require.NotContains(t, err.Error(), "pw", "nor the URL's password")
		})
	}
}

// TestPostRefusalsAreTypedAndNeverRetried posts to a real Tally that
// refuses the request: each refusal is one request, never retried, typed
// with the status and the server's code, names every event as not
// delivered, never carries the token, and stores nothing.
func TestPostRefusalsAreTypedAndNeverRetried(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		env    []string
		token  func(tl *tally) string
		events []client.Event
		status int
		code   string
	}{
		{"an unknown token", nil, func(*tally) string { return secretToken }, events("u", 2), http.StatusUnauthorized, "unauthorized"},
		{"a tenant the token may not post for", nil,
			func(tl *tally) string {
				return tl.newToken(auth.TokenSpec{Name: "other", Role: auth.RoleIngest, Tenants: []string{"other"}})
			}, events("f", 2), http.StatusForbidden, "forbidden_tenant"},
		{"a correction from a token that may not post one", nil, func(tl *tally) string { return tl.token },
			[]client.Event{{ID: "c-1", Tenant: "acme", Feature: "api_calls", Value: -3}}, http.StatusForbidden, "corrections_not_allowed"},
		{"a batch over the server's events", []string{"TALLY_INGEST_MAX_EVENTS=2"}, func(tl *tally) string { return tl.token },
			events("big", 3), http.StatusRequestEntityTooLarge, "batch_too_large"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tl := newTally(t, tc.env...)
			p := newProxy(t, tl.url, forward)
			token := tc.token(tl)
			c, err := client.New(p.url, token, client.WithBackoff(time.Millisecond, 5*time.Millisecond))
			require.NoError(t, err)

			res, err := c.Post(context.Background(), tc.events...)
			require.Zero(t, res)
			var (
				u      *client.UndeliveredError
				status *client.StatusError
				inv    *client.InvalidError
			)
			require.ErrorAs(t, err, &u)
			require.ErrorAs(t, err, &status)
			require.False(t, errors.As(err, &inv), "not a 422")
			require.Equal(t, tc.status, status.StatusCode)
			require.Equal(t, tc.code, status.Code)
			require.NotEmpty(t, status.Message)
			require.Len(t, u.Events, len(tc.events), "every event is named")
			for i, ud := range u.Events {
				require.Equal(t, tc.events[i], ud.Event)
				require.Same(t, status, ud.Err)
			}
			require.Equal(t, 1, p.requests(), "a refusal is never retried")
			require.NotContains(t, err.Error(), token)
			require.Empty(t, tl.ledger(), "nothing was stored")
		})
	}
}

// TestPostInvalidIsTypedAndNeverRetried posts batches a real Tally
// answers 422: the error carries the server's problems — index, field,
// reason — and nothing of the batch is stored; a call split into several
// requests says which of its events each problem names, what was stored
// before the refused request and what was never sent.
func TestPostInvalidIsTypedAndNeverRetried(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, forward)
	c := tl.client(p.url)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	first := client.Event{ID: "e-1", Tenant: "acme", Feature: "api_calls", Value: 1, Timestamp: at}
	_, err := c.Post(ctx, first)
	require.NoError(t, err)

	cases := []struct {
		name   string
		events []client.Event
		index  int
		field  string
		reason string
	}{
		{"an invalid field", []client.Event{
			{ID: "e-0", Tenant: "acme", Feature: "api_calls", Value: 1},
			{ID: "e-2", Tenant: "acme", Feature: "api_calls", Value: 2},
			{ID: "e-3", Tenant: "not a tenant", Feature: "api_calls", Value: 3},
		}, 2, "tenant", "1 to 64 characters"},
		{"an id stored before with other content", []client.Event{
			{ID: "e-0", Tenant: "acme", Feature: "api_calls", Value: 1},
			{ID: "e-1", Tenant: "acme", Feature: "api_calls", Value: 2, Timestamp: at},
		}, 1, "id", "stored before with different content"},
		{"an id stored before with a timestamp, posted without", []client.Event{
			{ID: "e-1", Tenant: "acme", Feature: "api_calls", Value: 1},
		}, 0, "id", "stored before with different content"},
	}
	for _, tc := range cases {
		before := p.requests()
		res, err := c.Post(ctx, tc.events...)
		require.Zero(t, res, tc.name)
		var inv *client.InvalidError
		require.ErrorAs(t, err, &inv, tc.name)
		require.Equal(t, http.StatusUnprocessableEntity, inv.StatusCode)
		require.Equal(t, "invalid_batch", inv.Code)
		require.Len(t, inv.Problems, 1, tc.name)
		require.NotNil(t, inv.Problems[0].Index)
		require.Equal(t, tc.index, *inv.Problems[0].Index, tc.name)
		require.Equal(t, tc.field, inv.Problems[0].Field, tc.name)
		require.Contains(t, inv.Problems[0].Reason, tc.reason, tc.name)
		var status *client.StatusError
		require.ErrorAs(t, err, &status, "a 422 is a StatusError too")
		require.Equal(t, 422, status.StatusCode)
		var u *client.UndeliveredError
		require.ErrorAs(t, err, &u)
		require.Len(t, u.Events, len(tc.events))
		require.Equal(t, inv.Problems, u.Events[tc.index].Problems, "the problem is attached to its event")
		require.Equal(t, 1, p.requests()-before, "%s: a 422 is never retried", tc.name)
	}
	tl.requireStored(first)

	// A call split into requests of two events: the second request is
	// refused; the first stays stored, the third is never sent.
	split := tl.client(p.url, client.WithRequestLimits(2, client.MaxRequestBytes), client.WithBatchSize(2))
	evs := events("s", 5)
	evs[3].Feature = "not a feature!"
	before := p.requests()
	res, err := split.Post(ctx, evs...)
	require.Equal(t, client.Result{Accepted: 2, Unmapped: 2}, res, "the first request was stored")
	require.Equal(t, 2, p.requests()-before, "no request after the refused one")
	var (
		u   *client.UndeliveredError
		inv *client.InvalidError
	)
	require.ErrorAs(t, err, &u)
	require.ErrorAs(t, err, &inv)
	require.Equal(t, 3, *inv.Problems[0].Index, "the index is the event's in the call, not in its request")
	require.Equal(t, "feature", inv.Problems[0].Field)
	require.Len(t, u.Events, 3)
	require.Equal(t, []client.Event{evs[2], evs[3], evs[4]}, []client.Event{u.Events[0].Event, u.Events[1].Event, u.Events[2].Event})
	require.Empty(t, u.Events[0].Problems)
	require.Equal(t, inv.Problems, u.Events[1].Problems)
	require.ErrorIs(t, u.Events[2].Err, client.ErrNotSent)
	tl.requireStored(first, evs[0], evs[1])

	// The events not delivered but valid go in once posted again.
	_, err = split.Post(ctx, evs[2], evs[4])
	require.NoError(t, err)
	tl.requireStored(first, evs[0], evs[1], evs[2], evs[4])
}

// TestPostRetriesWithTheSameBody has a proxy answer 503 and 502, then
// lose the reply of a request the real Tally stored: the client sends the
// same body each time, and the last retry is answered as duplicates —
// events without a timestamp included — not refused as changed; each event
// is stored once.
func TestPostRetriesWithTheSameBody(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, func(n int) action {
		switch n {
		case 1:
			return action{status: http.StatusServiceUnavailable}
		case 2:
			return action{status: http.StatusBadGateway, retryAfter: "0"}
		case 3:
			return action{loseReply: true}
		}
		return action{}
	})
	logs := &logSink{}
	c := tl.client(p.url, client.WithLogger(logs.logger()))
	evs := events("r", 3)
	evs[0].Timestamp = time.Date(2026, 11, 30, 10, 0, 0, 123456000, time.UTC)

	res, err := c.Post(context.Background(), evs...)
	require.NoError(t, err)
	require.Equal(t, client.Result{Duplicates: 3}, res, "the lost reply's request stored them; the retry finds duplicates")
	require.Equal(t, 4, p.requests())
	for n := 2; n <= 4; n++ {
		require.Equal(t, p.body(1), p.body(n), "attempt %d sends the same body", n)
	}
	require.Equal(t, []string{"Bearer " + tl.token}, slices.Compact(p.authorizations()), "every attempt carries the token")
	tl.requireStored(evs...)
	for _, ev := range evs[1:] {
		require.False(t, tl.ledger()["acme/"+ev.ID].Given, "Post sends no timestamp for one left zero")
	}

	retries := logs.lines("retrying POST /v1/usage")
	require.Len(t, retries, 3)
	require.Contains(t, retries[0], "cause=503")
	require.Contains(t, retries[2], "cause=\"network error: EOF\"", "the lost reply")
	require.NotContains(t, logs.String(), tl.token, "the token is never logged")
	require.NotContains(t, logs.String(), "r-1", "nor an event")
	require.NotContains(t, logs.String(), "the proxy says no", "nor an answer's body")
}

// TestPostHonoursRetryAfter is retried after the wait a 429's Retry-After
// asks for: a real Tally's quota (whole seconds), and an HTTP date.
func TestPostHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	t.Run("seconds, from Tally's quota", func(t *testing.T) {
		t.Parallel()
		tl := newTally(t, "TALLY_INGEST_REQUESTS_PER_SECOND=1")
		p := newProxy(t, tl.url, forward)
		logs := &logSink{}
		c := tl.client(p.url, client.WithLogger(logs.logger()))
		evs := events("q", 2)
		_, err := c.Post(context.Background(), evs[0])
		require.NoError(t, err)
		start := time.Now()
		res, err := c.Post(context.Background(), evs[1])
		require.NoError(t, err)
		require.GreaterOrEqual(t, time.Since(start), time.Second, "the retry waited for Retry-After: 1")
		require.Equal(t, client.Result{Accepted: 1, Unmapped: 1}, res)
		require.Equal(t, 3, p.requests(), "one 429, then the retry")
		require.Len(t, logs.lines("cause=\"429 rate_limited\""), 1)
		tl.requireStored(evs...)
	})
	t.Run("an HTTP date", func(t *testing.T) {
		t.Parallel()
		tl := newTally(t)
		until := time.Now().Add(2 * time.Second)
		p := newProxy(t, tl.url, func(n int) action {
			if n == 1 {
				return action{status: http.StatusTooManyRequests, retryAfter: until.UTC().Format(http.TimeFormat)}
			}
			return action{}
		})
		c := tl.client(p.url)
		evs := events("d", 1)
		_, err := c.Post(context.Background(), evs...)
		require.NoError(t, err)
		require.False(t, time.Now().Before(until.Truncate(time.Second)), "the retry waited until the date")
		require.Equal(t, 2, p.requests())
		tl.requireStored(evs...)
	})
}

// TestPostGivesUpWithinItsBudgetAndContext keeps a real Tally behind a
// proxy that fails every request: the retries end with the budget, at once
// when Retry-After asks for longer than the budget has left, with the
// context, or after one attempt with no budget; nothing is stored until
// the proxy lets the same events through.
func TestPostGivesUpWithinItsBudgetAndContext(t *testing.T) {
	t.Parallel()
	unavailable := func(int) action { return action{status: http.StatusServiceUnavailable} }
	cases := []struct {
		name     string
		plan     func(int) action
		opts     []client.Option
		timeout  time.Duration
		is       error
		status   int
		attempts func(t *testing.T, n int)
	}{
		{"the budget", unavailable, []client.Option{client.WithRetryBudget(150 * time.Millisecond)}, 0,
			client.ErrRetryBudgetSpent, http.StatusServiceUnavailable, func(t *testing.T, n int) { require.Greater(t, n, 2) }},
		{"a Retry-After past the budget", func(int) action { return action{status: http.StatusTooManyRequests, retryAfter: "3600"} },
			[]client.Option{client.WithRetryBudget(time.Minute)}, 0,
			client.ErrRetryBudgetSpent, http.StatusTooManyRequests, func(t *testing.T, n int) { require.Equal(t, 1, n) }},
		{"the context", unavailable, []client.Option{client.WithRetryBudget(time.Hour)}, 150 * time.Millisecond,
			context.DeadlineExceeded, http.StatusServiceUnavailable, func(t *testing.T, n int) { require.Greater(t, n, 2) }},
		{"no budget", unavailable, []client.Option{client.WithRetryBudget(0)}, 0,
			client.ErrRetryBudgetSpent, http.StatusServiceUnavailable, func(t *testing.T, n int) { require.Equal(t, 1, n) }},
		{"a 400, never retried", func(int) action { return action{status: http.StatusBadRequest} }, nil, 0,
			nil, http.StatusBadRequest, func(t *testing.T, n int) { require.Equal(t, 1, n) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tl := newTally(t)
			p := newProxy(t, tl.url, tc.plan)
			c := tl.client(p.url, tc.opts...)
			ctx := context.Background()
			if tc.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.timeout)
				defer cancel()
			}
			evs := events("b", 2)
			_, err := c.Post(ctx, evs...)
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			} else {
				require.NotErrorIs(t, err, client.ErrRetryBudgetSpent)
			}
			var status *client.StatusError
			require.ErrorAs(t, err, &status)
			require.Equal(t, tc.status, status.StatusCode)
			require.Empty(t, status.Code, "the proxy's answer is not Tally's error shape")
			require.NotContains(t, err.Error(), "the proxy says no", "an answer's body is never in an error")
			tc.attempts(t, p.requests())
			if tc.status == http.StatusTooManyRequests {
				require.Equal(t, time.Hour, status.RetryAfter)
			}
			require.Empty(t, tl.ledger())

			p.setPlan(forward)
			_, err = c.Post(context.Background(), evs...)
			require.NoError(t, err)
			tl.requireStored(evs...)
		})
	}
}

// TestPostSplitsWhatExceedsARequest posts more events than one request
// may carry, by count and by bytes: several requests, each within the
// limits, every event stored once.
func TestPostSplitsWhatExceedsARequest(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, forward)
	ctx := context.Background()

	byCount := tl.client(p.url, client.WithRequestLimits(4, client.MaxRequestBytes), client.WithBatchSize(4))
	evs := events("n", 10)
	res, err := byCount.Post(ctx, evs...)
	require.NoError(t, err)
	require.Equal(t, client.Result{Accepted: 10, Unmapped: 10}, res)
	require.Equal(t, 3, p.requests(), "4 + 4 + 2")

	const limit = 400
	byBytes := tl.client(p.url, client.WithRequestLimits(client.MaxRequestEvents, limit), client.WithBatchBytes(limit))
	more := events("bytes", 20)
	before := p.requests()
	res, err = byBytes.Post(ctx, more...)
	require.NoError(t, err)
	require.Equal(t, 20, res.Accepted)
	require.Greater(t, p.requests()-before, 2)
	for n := before + 1; n <= p.requests(); n++ {
		require.LessOrEqual(t, len(p.body(n)), limit, "request %d", n)
	}
	tl.requireStored(append(evs, more...)...)

	huge := client.Event{ID: strings.Repeat("x", limit), Tenant: "acme", Feature: "api_calls", Value: 1}
	before = p.requests()
	_, err = byBytes.Post(ctx, more[0], huge)
	require.ErrorIs(t, err, client.ErrEventTooLarge)
	require.Contains(t, err.Error(), "event 1")
	require.Equal(t, before, p.requests(), "nothing was sent")
}

// TestPostDoesNotRetryACertificateThatDoesNotVerify posts over HTTPS to a
// proxy whose certificate the client does not trust: one attempt, no
// retries; with an HTTP client that trusts it, the events are stored.
func TestPostDoesNotRetryACertificateThatDoesNotVerify(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p, trusting := newTLSProxy(t, tl.url)
	evs := events("tls", 2)
	_, err := tl.client(p.url, client.WithRetryBudget(time.Minute)).Post(context.Background(), evs...)
	require.ErrorContains(t, err, "certificate")
	require.NotErrorIs(t, err, client.ErrRetryBudgetSpent, "given up at once")
	require.Empty(t, tl.ledger())

	_, err = tl.client(p.url, client.WithHTTPClient(trusting)).Post(context.Background(), evs...)
	require.NoError(t, err)
	require.Equal(t, 1, p.requests(), "the untrusted attempt never reached the proxy's handler")
	tl.requireStored(evs...)
}
