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

// DefaultTimeout bounds each request of the default HTTP client.
const DefaultTimeout = 30 * time.Second

// Config configures a [Client].
type Config struct {
	// Key is the secret (sk_) or restricted (rk_) API key. Required.
	Key string
	// APIBase is the API's base URL. Default DefaultAPIBase; tests and
	// `tally dev` point it at the simulator.
	APIBase string
	// Account, when set, is sent as the Stripe-Account header on every
	// request (the Connect destination). It must start with acct_.
	Account string
	// HTTPClient sends the requests. Default: a client with a
	// DefaultTimeout timeout. It is not modified.
	HTTPClient *http.Client
	// BeforeRequest, when set, runs before every HTTP request the client
	// sends — each page of a list, too — with the request's context; an
	// error stops the request. The reconciler waits on the account's rate
	// limiter and counts its calls here.
	BeforeRequest func(ctx context.Context) error
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
	sc      *stripe.Client
	mode    Mode
	account string
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
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, configError("the Stripe API base must be an absolute http(s) URL without credentials, query or fragment")
	}
	if cfg.Account != "" && (!strings.HasPrefix(cfg.Account, "acct_") || strings.ContainsFunc(cfg.Account, func(r rune) bool { return r <= ' ' || r == 0x7f })) {
		return nil, configError("the Stripe account must be an account id starting with acct_")
	}

	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: DefaultTimeout}
	}
	// Every request goes through accountTransport: the Stripe-Account header
	// (when set), the BeforeRequest hook, the metrics and the span —
	// including the requests later packages make through Stripe().
	wrapped := *hc
	wrapped.Transport = accountTransport{base: hc.Transport, account: cfg.Account, before: cfg.BeforeRequest, metrics: cfg.Metrics}
	hc = &wrapped
	backends := stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(base),
		HTTPClient:        hc,
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     quietLogger{},
		EnableTelemetry:   stripe.Bool(false),
	})
	return &Client{
		sc:      stripe.NewClient(cfg.Key, stripe.WithBackends(backends)),
		mode:    mode,
		account: cfg.Account,
	}, nil
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

// accountTransport sets the Stripe-Account header when a request lacks it,
// and runs the BeforeRequest hook.
type accountTransport struct {
	base    http.RoundTripper
	account string
	before  func(context.Context) error
	metrics *RequestMetrics
}

func (t accountTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	base := t.base
	if base == nil {
		base = http.DefaultTransport
	}
	if t.before != nil {
		if err := t.before(r.Context()); err != nil {
			if r.Body != nil {
				_ = r.Body.Close()
			}
			return nil, err
		}
	}
	if t.account != "" && r.Header.Get("Stripe-Account") == "" {
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
