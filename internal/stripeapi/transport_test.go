package stripeapi_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
)

// A client built without an HTTP client of its own keeps the connections
// a burst of concurrent calls opened for the next burst: with Go's default
// of two idle connections a host, every burst but the first opened (and,
// against Stripe, handshook) nearly all of its connections again.
func TestDefaultClientReusesConnectionsAcrossBursts(t *testing.T) {
	t.Parallel()
	const concurrent, bursts = 32, 4
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct}})
	var opened atomic.Int64
	ts := httptest.NewUnstartedServer(sim.Handler())
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			opened.Add(1)
		}
	}
	ts.Start()
	t.Cleanup(ts.Close)
	c, err := stripeapi.New(stripeapi.Config{Key: testKey, APIBase: ts.URL})
	require.NoError(t, err)

	var first int64
	for burst := range bursts {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range concurrent {
			wg.Go(func() {
				<-start
				// The answer (a 404 for a customer nobody made) does not
				// matter: only that the call was answered and its body read.
				_, _ = c.Customer(context.Background(), "cus_nobody")
			})
		}
		close(start)
		wg.Wait()
		if burst == 0 {
			first = opened.Load()
			require.Positive(t, first)
		}
	}
	// No burst needs more than concurrent connections at once, and each
	// burst leaves its connections idle for the next: all four together
	// open about one burst's worth, a few more where a call finds every
	// idle one taken for a moment. The bound is on the total, not on the
	// first burst's count: the first burst may overlap less than a later
	// one (17 of 32 calls at once in one CI run). Go's default transport
	// opened 121.
	require.LessOrEqual(t, opened.Load(), int64(concurrent+concurrent/4),
		"connections opened: %d in the first burst, %d in all %d", first, opened.Load(), bursts)
}
