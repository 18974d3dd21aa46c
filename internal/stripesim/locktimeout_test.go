package stripesim_test

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
)

// TestLockTimeoutFault checks Faults.LockTimeouts against Stripe's rate
// limits page, "Object lock timeouts": a 429 with code lock_timeout and
// Stripe's message, of type invalid_request_error (the type Stripe gives a
// request it refuses, https://docs.stripe.com/api/errors), without
// Stripe-Rate-Limited-Reason (no limiter refused it), for the customer it
// names only; "Stripe doesn't process these failed requests", so nothing is
// recorded and nothing is kept for the Idempotency-Key: the same key is
// processed anew once the lock is free.
func TestLockTimeoutFault(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{LockTimeouts: map[string]float64{"cus_acme": 1}}})
	form := eventForm("api_calls", "cus_acme", "lt-1", "1", base)
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("lt-1-a1"))
	require.Equal(t, http.StatusTooManyRequests, r.status)
	assert.Equal(t, "lock_timeout", r.errField("code"))
	assert.Equal(t, "invalid_request_error", r.errField("type"))
	assert.Contains(t, r.errField("message"), "This object cannot be accessed right now")
	assert.Empty(t, r.header.Get("Stripe-Rate-Limited-Reason"), "not a limiter's 429")
	assert.Empty(t, sim.Events(acct), "not processed")
	assert.Equal(t, 1, sim.LockTimeouts(acct))
	assert.Empty(t, sim.RateLimited(acct), "not counted as a limiter's")

	// Another customer is not contended.
	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_beta", "lt-2", "1", base), nil)
	assert.Equal(t, http.StatusOK, r.status)

	// Nothing was kept for the key: once the lock is free, the same request
	// with the same key is processed.
	sim.Configure(acct, stripesim.Limits{})
	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("lt-1-a1"))
	assert.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.header.Get("Idempotent-Replayed"))
	assert.Len(t, sim.Events(acct), 2)

	// A fraction draws per call.
	sim.Configure(acct, stripesim.Limits{Faults: stripesim.Faults{LockTimeouts: map[string]float64{"cus_acme": 0.3}}})
	locked := 0
	for i := range 200 {
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", fmt.Sprint("lt-f-", i), "1", base), nil)
		if r.status == http.StatusTooManyRequests {
			locked++
		}
	}
	assert.InDelta(t, 60, locked, 25, "about 30%% of 200")
	assert.Panics(t, func() {
		sim.Configure(acct, stripesim.Limits{Faults: stripesim.Faults{LockTimeouts: map[string]float64{"cus_acme": 1.5}}})
	})
}
