package console

import (
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The throttle remembers a bounded number of addresses, forgetting the
// least recently seen: many addresses cannot grow it without bound.
func TestSignInThrottleMemoryIsBounded(t *testing.T) {
	t.Parallel()
	th := newSignInThrottle(signInLimits{Failures: 1, Every: time.Hour, GlobalFailures: 1 << 20, GlobalEvery: time.Nanosecond, Addresses: 10})
	fail := func(addr string) time.Duration {
		a, wait := th.admit(addr)
		if wait == 0 {
			a.finish(true)
		}
		return wait
	}
	require.Zero(t, fail("192.0.2.0"))
	require.Positive(t, fail("192.0.2.0"), "its one failure is spent")
	for i := 1; i <= 1000; i++ {
		if i%5 == 0 {
			require.Positive(t, fail("192.0.2.0"), "an address in use stays remembered")
		}
		fail(fmt.Sprintf("198.51.%d.%d", i/256, i%256))
		require.LessOrEqual(t, th.size(), 10)
	}
	require.Equal(t, 10, th.size())
	require.Zero(t, fail("198.51.0.1"), "forgotten long ago: it starts afresh")
}

// Attempts in flight hold their token: concurrent wrong guesses cannot
// overshoot the limit, and one that succeeds gives its token back.
func TestSignInThrottleCountsAttemptsInFlight(t *testing.T) {
	t.Parallel()
	th := newSignInThrottle(signInLimits{Failures: 2, Every: time.Minute, GlobalFailures: 100, GlobalEvery: time.Second, Addresses: 10})
	a1, w := th.admit("192.0.2.1")
	require.Zero(t, w)
	a2, w := th.admit("192.0.2.1")
	require.Zero(t, w)
	_, w = th.admit("192.0.2.1")
	require.Equal(t, time.Minute, w, "two in flight hold both tokens; Retry-After rounds up to whole seconds")
	a1.finish(false)
	a3, w := th.admit("192.0.2.1")
	require.Zero(t, w, "a success spends nothing")
	a2.finish(true)
	a3.finish(true)
	_, w = th.admit("192.0.2.1")
	require.Positive(t, w)
}

// The address is the connection's peer, parsed; an IPv6 client is
// throttled by its /64.
func TestClientAddress(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ remote, addr, key string }{
		{"192.0.2.1:5555", "192.0.2.1", "192.0.2.1"},
		{"[2001:db8:1:2:3::4]:443", "2001:db8:1:2:3::4", "2001:db8:1:2::/64"},
		{"[::ffff:192.0.2.9]:80", "192.0.2.9", "192.0.2.9"},
		{"[fe80::1%eth0]:80", "fe80::1", "fe80::/64"},
		{"not an address", "unknown", "unknown"},
	} {
		r := httptest.NewRequest("POST", "/console/login", nil)
		r.RemoteAddr = c.remote
		require.Equal(t, c.addr, clientAddr(r), c.remote)
		require.Equal(t, c.key, throttleKey(clientAddr(r)), c.remote)
	}
}
