package console

import (
	"net/http"
	"strconv"
	"time"
)

// ReadLimiter bounds the expensive pages in flight per token (and in all):
// api.ReadLimiter, shared with the API so that one global bound covers both.
type ReadLimiter interface {
	// Acquire takes a slot for one read of token, or answers ok false at
	// its bound; release gives the slot back.
	Acquire(token int64) (release func(), ok bool)
	// RetryAfter is how long a refused client is asked to wait.
	RetryAfter() time.Duration
}

// limitReads bounds an expensive page with c.ReadLimit (nil: unbounded):
// over the bound it answers 429 at once with a page that says so, never
// queueing. It runs after requireSession, so the slot is the session's
// token's.
func (c *Console) limitReads(next http.Handler) http.Handler {
	if c.ReadLimit == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, _ := sessionOf(r)
		release, ok := c.ReadLimit.Acquire(s.TokenID)
		if !ok {
			wait := c.ReadLimit.RetryAfter()
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())))
			http.Error(w, "Too many reports are running for your token or on this node. "+
				"Nothing went wrong: reload this page in "+strconv.Itoa(int(wait.Seconds()))+" seconds.", http.StatusTooManyRequests)
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}
