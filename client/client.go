package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// Client posts usage to one Tally. It is safe for concurrent use. A Client
// that was given events by Add must be closed (Close) to deliver the last
// of them.
type Client struct {
	endpoint string // baseURL's /v1/usage
	token    string // sent in Authorization only
	cfg      config
	log      *slog.Logger

	// The buffer of Add, guarded by mu; the sender goroutine, started by
	// the first Add, drains it.
	mu  sync.Mutex
	buf buffer

	// wake tells the sender to look at the buffer again. Add (an event in
	// an empty buffer, a batch full), Flush and Close write to it without
	// blocking; the sender reads it.
	wake chan struct{}
	// sendCtx is the context of the sender's requests; abort cancels it
	// when Close's context ends before everything was delivered.
	sendCtx context.Context
	abort   context.CancelFunc
	// done is closed by the sender when it returns.
	done chan struct{}
}

// New returns a client of the Tally at baseURL (e.g. "https://tally.internal",
// or with a path prefix a proxy serves it under) that authenticates with
// token, a token of the ingest role or above. The token is sent only in the
// Authorization header of POST /v1/usage; it is never logged or put in an
// error. New reports every problem of its arguments and options at once; it
// starts nothing and makes no request.
func New(baseURL, token string, opts ...Option) (*Client, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		o(&cfg)
	}
	var errs []error
	endpoint, err := usageEndpoint(baseURL)
	if err != nil {
		errs = append(errs, err)
	}
	if err := checkToken(token); err != nil {
		errs = append(errs, err)
	}
	if err := cfg.validate(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("client: %w", errors.Join(errs...))
	}
	cfg.httpClient = noRedirects(cfg.httpClient)
	log := cfg.logger
	if log == nil {
		log = slog.Default()
	}
	sendCtx, abort := context.WithCancel(context.Background())
	c := &Client{endpoint: endpoint, token: token, cfg: cfg, log: log,
		wake: make(chan struct{}, 1), sendCtx: sendCtx, abort: abort, done: make(chan struct{})}
	c.buf.init()
	return c, nil
}

// usageEndpoint is POST /v1/usage under baseURL.
func usageEndpoint(baseURL string) (string, error) {
	u, err := url.Parse(baseURL)
	switch {
	case err != nil:
		return "", errors.New("the base URL does not parse")
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("the base URL must be http or https, not %q", u.Scheme)
	case u.Host == "":
		return "", errors.New("the base URL has no host")
	case u.User != nil:
		return "", errors.New("the base URL must not carry credentials: give the token as the token argument")
	case u.RawQuery != "" || u.Fragment != "":
		return "", errors.New("the base URL must not have a query or a fragment")
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + "/v1/usage"
	u.RawPath = ""
	return u.String(), nil
}

// noRedirects is a copy of hc that answers a redirect as it came instead
// of following it: a redirect would re-send the token to wherever it points,
// over http too, and a 301, 302 or 303 would turn the POST into a GET whose
// answer says nothing of the events.
func noRedirects(hc *http.Client) *http.Client {
	cp := *hc
	cp.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &cp
}

// checkToken refuses a token that could not travel in a header. The error
// never repeats it.
func checkToken(token string) error {
	if token == "" {
		return errors.New("the token is empty")
	}
	for i := 0; i < len(token); i++ {
		if token[i] <= ' ' || token[i] > '~' {
			return errors.New("the token must be printable ASCII without spaces")
		}
	}
	return nil
}
