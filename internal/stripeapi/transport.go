package stripeapi

import (
	"net/http"
	"sync"
	"time"
)

// MaxIdleConnsPerHost is how many idle connections to one Stripe host the
// shared transport keeps for reuse. Go's default is 2: with 64 v1 sends or
// 20 stream requests in flight (the defaults), all but two of the
// connections a burst opened were closed as it ended and opened again —
// a TCP and TLS handshake each — for the next. 128 covers both deliverers'
// default concurrency, the adjustments and the reconciler on one host.
const MaxIdleConnsPerHost = 128

// sharedTransport is http.DefaultTransport's settings (proxy from the
// environment, dial and TLS handshake timeouts, HTTP/2 when the server
// offers it) with MaxIdleConnsPerHost idle connections a host. One for
// the process, so every client of every account shares its connections.
var sharedTransport = sync.OnceValue(func() http.RoundTripper {
	base, ok := http.DefaultTransport.(*http.Transport)
	if !ok {
		// Somebody replaced the default transport: theirs is the
		// process's policy.
		return http.DefaultTransport
	}
	t := base.Clone()
	t.MaxIdleConns = 2 * MaxIdleConnsPerHost
	t.MaxIdleConnsPerHost = MaxIdleConnsPerHost
	return t
})

// Transport is the transport of every client built without an HTTP client
// of its own, and of an HTTP client whose Transport is nil.
func Transport() http.RoundTripper { return sharedTransport() }

// DefaultHTTPClient is a client on Transport whose requests time out after
// timeout.
func DefaultHTTPClient(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: Transport()}
}
