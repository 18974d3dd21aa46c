package client_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/client"
)

// recorder is a server a redirect points to: it answers every request 202
// as Tally would, and records the requests and Authorization headers it got.
type recorder struct {
	mu   sync.Mutex
	auth []string
}

func newRecorder(t *testing.T) (*recorder, string) {
	t.Helper()
	r := &recorder{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		r.mu.Lock()
		r.auth = append(r.auth, req.Header.Get("Authorization"))
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, `{"accepted":2,"duplicates":0}`)
	}))
	t.Cleanup(srv.Close)
	return r, srv.URL
}

func (r *recorder) requests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.auth...)
}

// newRedirector is an HTTPS server answering every request with status and
// a Location under to, and an HTTP client that trusts it.
func newRedirector(t *testing.T, status int, to string) (string, *http.Client) {
	t.Helper()
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		http.Redirect(w, req, to+req.URL.Path+"?from=redirect", status)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, srv.Client()
}

// TestRedirectIsNeverFollowedNorDelivered posts over HTTPS to a server that
// redirects to another over http: the client follows no redirect, even
// with an HTTP client of its own that would, so the other server sees no
// request and no token; the events are reported not delivered with the
// status and where it pointed, and the request is not retried.
func TestRedirectIsNeverFollowedNorDelivered(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusFound, http.StatusPermanentRedirect} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			rec, recURL := newRecorder(t)
			url, trusting := newRedirector(t, status, recURL)
			var logs logSink
			c, err := client.New(url, secretToken, client.WithHTTPClient(trusting),
				client.WithRetryBudget(time.Minute), client.WithLogger(logs.logger()))
			require.NoError(t, err)

			evs := events("redirect", 2)
			res, err := c.Post(context.Background(), evs...)
			require.Zero(t, res, "nothing counted delivered")
			var u *client.UndeliveredError
			require.ErrorAs(t, err, &u)
			require.Len(t, u.Events, 2)
			var re *client.RedirectError
			require.ErrorAs(t, err, &re)
			require.Equal(t, status, re.StatusCode)
			require.Equal(t, recURL, re.Location, "scheme and host only")
			var se *client.StatusError
			require.ErrorAs(t, err, &se)
			require.NotErrorIs(t, err, client.ErrRetryBudgetSpent, "given up at once")
			require.Contains(t, err.Error(), http.StatusText(status))
			require.Contains(t, err.Error(), recURL)
			require.NotContains(t, err.Error(), "from=redirect", "no path or query of the Location")
			require.NotContains(t, err.Error(), secretToken)
			require.Empty(t, logs.lines("retrying"))
			require.Nil(t, trusting.CheckRedirect, "the HTTP client given is not changed")

			require.NoError(t, c.Add(context.Background(), evs[0]))
			err = c.Close(context.Background())
			require.True(t, errors.As(err, &re), "a buffered event redirected is reported, not delivered: %v", err)
			require.Empty(t, rec.requests(), "the redirect's target saw nothing")
		})
	}
}
