package stripeapi

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// DefaultAPIBase is the real Stripe API.
const DefaultAPIBase = "https://api.stripe.com"

// DefaultMeterEventsBase is the host of Stripe's v2 meter event stream.
const DefaultMeterEventsBase = "https://meter-events.stripe.com"

// DefaultTimeout bounds each request of the default HTTP client.
const DefaultTimeout = 30 * time.Second

// Config configures a [Client].
type Config struct {
	// Key is the secret (sk_) or restricted (rk_) API key. Required.
	Key string
	// APIBase is the API's base URL. Default DefaultAPIBase; tests and
	// `tally dev` point it at the simulator.
	APIBase string
	// MeterEventsBase is the v2 meter event stream's base URL
	// (STRIPE_METER_EVENTS_BASE). Default DefaultMeterEventsBase.
	MeterEventsBase string
	// Account, when set, is sent as the Stripe-Account header on every
	// request that names no Stripe-Context (the Connect destination). It
	// must start with acct_.
	Account string
	// HTTPClient sends the requests. Default: DefaultHTTPClient with a
	// DefaultTimeout timeout; a client whose Transport is nil sends on
	// Transport. It is not modified.
	HTTPClient *http.Client
	// BeforeRequest, when set, runs before every HTTP request the client
	// sends — each page of a list, too — with the request's context; an
	// error stops the request. The reconciler waits on the account's rate
	// limiter and counts its calls here.
	BeforeRequest func(ctx context.Context) error
	// Pace, when set, runs before every HTTP request the client sends,
	// before BeforeRequest, with the request's context, method and path:
	// the destination's budget waits there for the calls no deliverer
	// paced. An error stops the request.
	Pace func(ctx context.Context, method, path string) error
	// Metrics, when set, counts every call by endpoint and status class.
	Metrics *RequestMetrics
}

// Mode is the mode of a Stripe key.
type Mode string

// The modes of Stripe keys.
const (
	ModeLive Mode = "live"
	ModeTest Mode = "test"
)

// ModeOfKey returns the mode of an API key from its prefix: sk_live_ and
// rk_live_ are live, sk_test_ and rk_test_ are test. Any other key is an
// error that names the accepted prefixes and never echoes the key.
func ModeOfKey(key string) (Mode, error) {
	for prefix, mode := range map[string]Mode{
		"sk_live_": ModeLive, "rk_live_": ModeLive,
		"sk_test_": ModeTest, "rk_test_": ModeTest,
	} {
		if strings.HasPrefix(key, prefix) && len(key) > len(prefix) {
			return mode, nil
		}
	}
	return "", configError("the Stripe key must be a secret or restricted key starting with sk_live_, rk_live_, sk_test_ or rk_test_")
}

// Client is Tally's Stripe client. It is safe for concurrent use.
type Client struct {
	sc       *stripe.Client
	backends *stripe.Backends
	key      string // for calls made on the backends directly
	mode     Mode
	account  string
}

// New validates cfg and builds the client. It makes no request.
func New(cfg Config) (*Client, error) {
	if cfg.Key == "" {
		return nil, configError("the Stripe key is required")
	}
	mode, err := ModeOfKey(cfg.Key)
	if err != nil {
		return nil, err
	}
	if strings.IndexFunc(cfg.Key, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
		return nil, configError("the Stripe key contains whitespace or control characters")
	}
	base := cfg.APIBase
	if base == "" {
		base = DefaultAPIBase
	}
	if !baseURL(base) {
		return nil, configError("the Stripe API base must be an absolute http(s) URL without credentials, query or fragment")
	}
	meterBase := cfg.MeterEventsBase
	if meterBase == "" {
		meterBase = DefaultMeterEventsBase
	}
	if !baseURL(meterBase) {
		return nil, configError("the Stripe meter events base must be an absolute http(s) URL without credentials, query or fragment")
	}
	if cfg.Account != "" && !ValidAccount(cfg.Account) {
		return nil, configError("the Stripe account must be an account id starting with acct_")
	}

	hc := cfg.HTTPClient
	if hc == nil {
		hc = DefaultHTTPClient(DefaultTimeout)
	}
	// Every request goes through accountTransport: the Stripe-Account header
	// (when set), the BeforeRequest hook, the metrics and the span —
	// including the requests later packages make through Stripe().
	wrapped := *hc
	wrapped.Transport = accountTransport{base: hc.Transport, account: cfg.Account, pace: cfg.Pace, before: cfg.BeforeRequest, metrics: cfg.Metrics}
	hc = &wrapped
	backends := stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(base),
		HTTPClient:        hc,
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     quietLogger{},
		EnableTelemetry:   stripe.Bool(false),
	})
	backends.MeterEvents = stripe.GetBackendWithConfig(stripe.MeterEventsBackend, &stripe.BackendConfig{
		URL:               stripe.String(meterBase),
		HTTPClient:        hc,
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     quietLogger{},
		EnableTelemetry:   stripe.Bool(false),
	})
	return &Client{
		sc:       stripe.NewClient(cfg.Key, stripe.WithBackends(backends)),
		backends: backends,
		key:      cfg.Key,
		mode:     mode,
		account:  cfg.Account,
	}, nil
}

// baseURL reports whether base is an absolute http(s) URL without
// credentials, query or fragment.
func baseURL(base string) bool {
	u, err := url.Parse(base)
	return err == nil && (u.Scheme == "https" || u.Scheme == "http") && u.Host != "" && u.User == nil && u.RawQuery == "" && u.Fragment == ""
}

// SessionClient returns a stripe-go client that authenticates with a v2
// meter event session's token instead of the API key, over the same
// backends and transport (metrics, spans, the BeforeRequest hook), for the
// meter event stream. Pass its errors through [WrapError] too.
func (c *Client) SessionClient(token string) *stripe.Client {
	return stripe.NewClient(token, stripe.WithBackends(c.backends))
}

// Stripe returns the underlying stripe-go client, for the exporter. Pass its
// errors through [WrapError] before they leave the caller.
func (c *Client) Stripe() *stripe.Client { return c.sc }

// Mode returns the mode of the client's key.
func (c *Client) Mode() Mode { return c.mode }

// AccountID returns the account the client acts on: Config.Account when
// set (without a request), else the key's own account from GET /v1/account.
func (c *Client) AccountID(ctx context.Context) (string, error) {
	if c.account != "" {
		return c.account, nil
	}
	a, err := c.sc.V1Accounts.Retrieve(ctx, &stripe.AccountRetrieveParams{})
	if err != nil {
		return "", WrapError(err)
	}
	if a.ID == "" {
		return "", &Error{Code: CodeBadResponse, message: "Stripe returned an account without an id"}
	}
	return a.ID, nil
}

// ValidAccount reports whether id is a Stripe account id Tally may send as
// Stripe-Account: acct_ and at least one more character, nothing below
// space or DEL.
func ValidAccount(id string) bool {
	return strings.HasPrefix(id, "acct_") && len(id) > len("acct_") && len(id) <= 255 &&
		!strings.ContainsFunc(id, func(r rune) bool { return r <= ' ' || r == 0x7f })
}

// For returns a client acting on account (a connected account, Connect):
// the same key, backends and transport, with Stripe-Account: account on
// every call its methods make. "" or the client's own account returns c.
// Calls made through Stripe() set the header themselves.
func (c *Client) For(account string) (*Client, error) {
	if account == "" || account == c.account {
		return c, nil
	}
	if !ValidAccount(account) {
		return nil, configError("the Stripe account must be an account id starting with acct_")
	}
	cc := *c
	cc.account = account
	return &cc, nil
}

// CheckAccess asks Stripe whether the key may act for account (GET
// /v1/account with Stripe-Account: account): nil when Stripe answers that
// account. A key that may not answers account_invalid (docs/stripe.md);
// any failure is an *Error.
func (c *Client) CheckAccess(ctx context.Context, account string) error {
	if !ValidAccount(account) {
		return configError("the Stripe account must be an account id starting with acct_")
	}
	p := &stripe.AccountRetrieveParams{}
	p.SetStripeAccount(account)
	a, err := c.sc.V1Accounts.Retrieve(ctx, p)
	if err != nil {
		return WrapError(err)
	}
	if a.ID != account {
		return &Error{Code: CodeBadResponse, HTTPStatus: http.StatusOK, message: "Stripe answered another account than the one asked for"}
	}
	return nil
}

// accountTransport sets the Stripe-Account header when a request lacks it
// and names no Stripe-Context, and runs the Pace and BeforeRequest hooks.
type accountTransport struct {
	base    http.RoundTripper
	account string
	pace    func(ctx context.Context, method, path string) error
	before  func(context.Context) error
	metrics *RequestMetrics
}

func (t accountTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	base := t.base
	if base == nil {
		base = Transport()
	}
	stop := func(err error) (*http.Response, error) {
		if r.Body != nil {
			_ = r.Body.Close()
		}
		return nil, err
	}
	if t.pace != nil {
		if err := t.pace(r.Context(), r.Method, r.URL.Path); err != nil {
			return stop(err)
		}
	}
	if t.before != nil {
		if err := t.before(r.Context()); err != nil {
			return stop(err)
		}
	}
	// The stream's session fixed the account; the header is for API-key
	// calls only. A call in a Stripe-Context (an event of a connected
	// account) gets none: the context supersedes Stripe-Account, and a
	// second account beside it would be ambiguous.
	if t.account != "" && r.Header.Get("Stripe-Account") == "" && r.Header.Get("Stripe-Context") == "" &&
		!strings.HasSuffix(r.URL.Path, StreamPath) {
		r = r.Clone(r.Context())
		r.Header.Set("Stripe-Account", t.account)
	}
	// An HTTP client span (semantic conventions): the method, the endpoint
	// without ids, the host, the status. Never the query, a header or a body.
	endpoint := EndpointOf(r.URL.Path)
	ctx, span := tracer.Start(r.Context(), r.Method+" "+endpoint, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(semconv.HTTPRequestMethodKey.String(r.Method), semconv.ServerAddress(r.URL.Hostname()),
			semconv.URLTemplate(endpoint)))
	defer span.End()
	resp, err := base.RoundTrip(r.WithContext(ctx))
	status := 0
	if err == nil {
		status = resp.StatusCode
		if m, _ := r.Context().Value(responseKey{}).(*Response); m != nil {
			m.Status, m.RequestID = status, sanitize(resp.Header.Get("Request-Id"))
			m.ShouldRetry, m.RetryAfter = resp.Header.Get("Stripe-Should-Retry"), resp.Header.Get("Retry-After")
			m.RateLimitedReason = sanitize(resp.Header.Get("Stripe-Rate-Limited-Reason"))
			m.Replayed = resp.Header.Get("Idempotent-Replayed") == "true"
		}
		span.SetAttributes(semconv.HTTPResponseStatusCode(status))
		if status >= 400 {
			span.SetAttributes(semconv.ErrorTypeKey.String(strconv.Itoa(status)))
			span.SetStatus(codes.Error, "")
		}
	} else {
		span.SetAttributes(semconv.ErrorTypeKey.String("no_answer"))
		span.SetStatus(codes.Error, "no answer")
	}
	t.metrics.Observe(r.URL.Path, status)
	return resp, err
}

// StreamPath is the v2 meter event stream's path.
const StreamPath = "/v2/billing/meter_event_stream"

// Response is what a call's HTTP response said outside its body: stripe-go
// gives v2 errors without their status, so the exporter reads it here.
type Response struct {
	// Status is the HTTP status; 0 when no response came back.
	Status int
	// RequestID is the Request-Id header, sanitised.
	RequestID string
	// ShouldRetry and RetryAfter are the Stripe-Should-Retry and
	// Retry-After headers as sent.
	ShouldRetry, RetryAfter string
	// RateLimitedReason is the Stripe-Rate-Limited-Reason header, sanitised:
	// which of Stripe's limiters refused the call (a 429 without it did not
	// come from a limiter).
	RateLimitedReason string
	// Replayed is the Idempotent-Replayed header: the answer is the one
	// Stripe kept for the request's Idempotency-Key.
	Replayed bool
}

type responseKey struct{}

// WithResponse returns a context whose call, made through a [Client], fills
// in the returned *Response. One call per context.
func WithResponse(ctx context.Context) (context.Context, *Response) {
	m := &Response{}
	return context.WithValue(ctx, responseKey{}, m), m
}

// tracer makes the spans of Stripe calls, on the global provider (a no-op
// unless telemetry.Setup installed one).
var tracer = otel.Tracer("github.com/tallymeter/tally/internal/stripeapi")

// quietLogger is stripe-go's logger: it discards everything, since
// stripe-go logs request failures with response bodies.
type quietLogger struct{}

func (quietLogger) Debugf(string, ...any) {}
func (quietLogger) Errorf(string, ...any) {}
func (quietLogger) Infof(string, ...any)  {}
func (quietLogger) Warnf(string, ...any)  {}

var _ stripe.LeveledLoggerInterface = quietLogger{}
