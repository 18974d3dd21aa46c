package stripesim

import (
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
)

// DefaultKey and DefaultAccount are the only key and account a [Server]
// knows when [Options.Keys] is empty.
const (
	DefaultKey     = "sk_test_sim"
	DefaultAccount = "acct_sim"
)

// Options configures a [Server].
type Options struct {
	// Keys are the API keys the simulator accepts: API key -> account id.
	// Keys starting sk_live_ or rk_live_ are live mode; every other key
	// (normally sk_test_ or rk_test_) is test mode. A key's mode is the
	// livemode flag of the objects it creates and sees. Default: one
	// account DefaultAccount with the key DefaultKey.
	Keys map[string]string
	// Now is the simulator's clock: created/updated timestamps, the meter
	// event timestamp window, the 24-hour identifier, idempotency-key and
	// cancellation windows and session expiry. Tests move it to move time.
	// Default: time.Now. (Rate limiting and latency use the real clock.)
	Now func() time.Time
	// Limits are the limits and faults of every account that has none of its
	// own (see [Server.Configure]). Default: none.
	Limits Limits
	// Seed seeds the random source the faults draw from, for reproducible
	// runs. 0 seeds it randomly.
	Seed uint64
	// AccountInvalidStatus is the HTTP status of the account_invalid error
	// a call with a Stripe-Account the key may not use gets (an unknown
	// account, or one whose access was revoked, RevokeAccess). Stripe's
	// pages give the code, not the status (docs/stripe.md): 403 by
	// default, the status commonly seen; tests set 400 for the worst case.
	AccountInvalidStatus int
	// CancelAgainSucceeds makes a cancellation of an event already
	// cancelled answer like the first (200, complete) instead of a 400:
	// Stripe does not document what cancelling twice answers
	// (docs/stripe.md), and the worst plausible answer is the one that
	// looks like success and proves nothing.
	CancelAgainSucceeds bool
	// Samples is the shape of the request an error report's sample names
	// (data.reason.error_types[].sample_errors[].request). Default
	// SamplesRequest, Stripe's documented example.
	Samples SampleShape
	// EventsList is which parameters GET /v2/core/events takes. Default
	// ListFiltered.
	EventsList ListSupport
	// ListWithoutData leaves data out of the events GET /v2/core/events
	// lists, as thin events: a client must fetch each to read it. Stripe's
	// example lists them with data.
	ListWithoutData bool
	// DeliveryRetries is how long after an error report was created
	// [Server.DeliverReports] still tries to deliver it, by the simulator's
	// clock; past it an undelivered report is abandoned, as Stripe stops
	// retrying. Default DefaultDeliveryRetries.
	DeliveryRetries time.Duration
	// InvoiceGrace is the finalization grace period of the drafts the
	// billing cycle makes: a draft with auto_advance finalizes this long
	// after it was created. Default DefaultInvoiceGrace (1 hour, Stripe's
	// default; Stripe lets an account set up to 72 hours).
	InvoiceGrace time.Duration
}

// Server is the simulator. It is safe for concurrent use.
type Server struct {
	now     func() time.Time
	handler http.Handler
	mux     *chi.Mux // the routes, to name a request's endpoint

	mu       sync.Mutex
	keys     map[string]string   // API key -> account id
	accounts map[string]*account // known accounts
	requests []Recorded
	idem     map[idemKey]*idemEntry
	seq      uint64              // receipt order of meter events, all accounts
	sessions map[string]*session // v2 meter event session token -> session
	invalid  int                 // the status of account_invalid (Options.AccountInvalidStatus)
	again    bool                // Options.CancelAgainSucceeds
	samples  SampleShape         // Options.Samples
	listing  ListSupport         // Options.EventsList
	thinList bool                // Options.ListWithoutData
	retries  time.Duration       // Options.DeliveryRetries
	grace    time.Duration       // Options.InvoiceGrace
	lim      limiter             // limits, faults and in-flight calls
	closed   chan struct{}       // closed by Close: releases hung requests
	close1   sync.Once
}

// account is the state of one Stripe account, both modes.
type account struct {
	id        string
	created   time.Time
	meters    []*Meter // creation order
	customers map[modeID]*customer
	events    []*event            // every recording, receipt order, both modes
	idents    map[modeID]*identSt // identifier -> its recordings
	reports   []ErrorReport       // creation order
	delivered map[string]bool     // events delivered by DeliverReports and DeliverMeterEvents
	abandoned map[string]bool     // error reports DeliverReports gave up on
	// meterEvents are the v1 events about meters (created, deactivated,
	// reactivated), creation order.
	meterEvents []MeterEvent
	// revoked: the platform's access to this connected account was
	// revoked (RevokeAccess); its state is kept for RestoreAccess.
	revoked bool

	products map[modeID]*product
	prices   []*price        // creation order
	subs     []*subscription // creation order
	invoices []*invoice      // creation order
	// invoiceNumbers counts the finalized invoices of each customer, for
	// their numbers.
	invoiceNumbers map[modeID]int
	// v1Events are every v1 snapshot event — meter, subscription and
	// invoice events — in the order they were recorded.
	v1Events []v1Event
}

// modeID is an id scoped to one mode of an account.
type modeID struct {
	livemode bool
	id       string
}

// Recorded is one request the simulator received. It never holds the API
// key or the Authorization header.
type Recorded struct {
	Time      time.Time
	RequestID string // the Request-Id the simulator answered with
	Method    string
	Path      string
	// Account is the account the request acted on: the Stripe-Context or
	// Stripe-Account header when accepted (the context when both are
	// sent), else the key's own account. Empty when authentication failed.
	Account string
	// StripeAccount and StripeContext are the Stripe-Account and
	// Stripe-Context headers as sent (empty if absent).
	StripeAccount  string
	StripeContext  string
	Livemode       bool
	IdempotencyKey string
	// Form holds the query and form-body values.
	Form url.Values
	// Status is the HTTP status the simulator answered with.
	Status int
	// Replayed is true when the response was an idempotent replay.
	Replayed bool
}

// New returns a simulator with the accounts and keys of opts.
func New(opts Options) *Server {
	s := &Server{
		now:      opts.Now,
		keys:     map[string]string{},
		accounts: map[string]*account{},
		idem:     map[idemKey]*idemEntry{},
		sessions: map[string]*session{},
		closed:   make(chan struct{}),
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.invalid, s.again = opts.AccountInvalidStatus, opts.CancelAgainSucceeds
	s.samples, s.listing, s.thinList, s.retries = opts.Samples, opts.EventsList, opts.ListWithoutData, opts.DeliveryRetries
	if s.retries <= 0 {
		s.retries = DefaultDeliveryRetries
	}
	s.grace = opts.InvoiceGrace
	if s.grace <= 0 {
		s.grace = DefaultInvoiceGrace
	}
	if s.invalid == 0 {
		s.invalid = http.StatusForbidden
	}
	s.lim.init(opts.Limits, opts.Seed)
	keys := opts.Keys
	if len(keys) == 0 {
		keys = map[string]string{DefaultKey: DefaultAccount}
	}
	for k, a := range keys {
		s.AddKey(k, a)
	}
	s.handler = s.withDebug(s.routes())
	return s
}

func (s *Server) routes() http.Handler {
	r := chi.NewRouter()
	s.mux = r
	r.Use(s.begin, s.authenticate, s.gate, s.idempotent, s.execute)
	r.NotFound(s.unrecognized)
	r.MethodNotAllowed(s.unrecognized)

	r.Get("/v1/account", s.getAccount)

	r.Get("/v1/billing/meters", s.listMeters)
	r.Post("/v1/billing/meters", s.createMeter)
	r.Get("/v1/billing/meters/{id}", s.getMeter)
	r.Post("/v1/billing/meters/{id}/deactivate", s.deactivateMeter)
	r.Post("/v1/billing/meters/{id}/reactivate", s.reactivateMeter)
	r.Get("/v1/billing/meters/{id}/event_summaries", s.listEventSummaries)

	r.Post("/v1/customers", s.createCustomer)
	r.Get("/v1/customers/{id}", s.getCustomer)
	r.Post("/v1/customers/{id}", s.updateCustomer)
	r.Delete("/v1/customers/{id}", s.deleteCustomer)

	r.Post("/v1/prices", s.createPrice)
	r.Get("/v1/prices", s.listPrices)
	r.Get("/v1/prices/{id}", s.getPrice)

	r.Post("/v1/subscriptions", s.createSubscription)
	r.Get("/v1/subscriptions", s.listSubscriptions)
	r.Get("/v1/subscriptions/{id}", s.getSubscription)
	r.Post("/v1/subscriptions/{id}", s.updateSubscription)
	r.Delete("/v1/subscriptions/{id}", s.cancelSubscription)
	r.Delete("/v1/subscription_items/{id}", s.deleteSubscriptionItem)

	r.Get("/v1/invoices", s.listInvoices)
	r.Get("/v1/invoices/{id}", s.getInvoice)
	r.Post("/v1/invoices/{id}", s.updateInvoice)
	r.Get("/v1/invoices/{id}/lines", s.listInvoiceLines)
	r.Post("/v1/invoices/{id}/finalize", s.finalizeInvoice)

	r.Get(v1EventsPath, s.listV1Events)
	r.Get(v1EventsPath+"/{id}", s.getV1Event)

	r.Post(meterEventsPath, s.createMeterEvent)
	r.Post(adjustmentsPath, s.createAdjustment)

	r.Get(eventsPath, s.listEvents)
	r.Get(eventsPath+"/{id}", s.getEvent)
	r.Post("/v2/billing/meter_event_session", s.createSession)
	r.Post(streamPath, s.stream)
	return r
}

// Handler returns the simulator's HTTP handler, to mount on
// httptest.NewServer or a listener.
func (s *Server) Handler() http.Handler { return s.handler }

// AddKey makes key an API key of account, adding the account if it is new.
// Adding an existing key moves it to account.
func (s *Server) AddKey(key, account string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys[key] = account
	s.accountLocked(account)
}

// RevokeKey stops accepting key, as a rolled or deleted key: calls with it
// answer 401.
func (s *Server) RevokeKey(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.keys, key)
}

// AddAccount makes account known without giving it a key, so that it can be
// reached with the Stripe-Account header (a Connect destination).
func (s *Server) AddAccount(account string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.accountLocked(account)
}

// RevokeAccess revokes the platform's access to connected account
// account, as its owner disconnecting the platform would: calls with
// Stripe-Account: account, and stream sessions created for it, answer
// account_invalid until RestoreAccess. Its meters, customers and events
// are kept. The account is added if new.
func (s *Server) RevokeAccess(account string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.accountLocked(account).revoked = true
}

// RestoreAccess gives the platform its access to account again.
func (s *Server) RestoreAccess(account string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.accountLocked(account).revoked = false
}

// accountInvalid is the error of a Stripe-Account the key may not use.
func (s *Server) accountInvalid(key, account string) *apiError {
	return errInvalid(s.invalid, "account_invalid", "",
		"The provided key '%s' does not have access to account '%s' (or that account does not exist). Application access may have been revoked.",
		maskKey(key), account)
}

// accountLocked returns the account, adding it if new. s.mu must be held.
func (s *Server) accountLocked(id string) *account {
	a := s.accounts[id]
	if a == nil {
		a = &account{id: id, created: s.now(), customers: map[modeID]*customer{}, idents: map[modeID]*identSt{},
			delivered: map[string]bool{}, abandoned: map[string]bool{}, products: map[modeID]*product{},
			invoiceNumbers: map[modeID]int{}}
		s.accounts[id] = a
	}
	return a
}

// Close releases every request held by the Hang fault, which then answers
// 500. Call it before closing a listener whose clients have no timeout.
// The simulator keeps serving other requests; later hangs end at once.
func (s *Server) Close() {
	s.close1.Do(func() { close(s.closed) })
}

// Requests returns every request received so far, in the order their
// responses completed.
func (s *Server) Requests() []Recorded {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Recorded, len(s.requests))
	for i, r := range s.requests {
		r.Form = cloneValues(r.Form)
		out[i] = r
	}
	return out
}

func cloneValues(v url.Values) url.Values {
	if v == nil {
		return nil
	}
	out := make(url.Values, len(v))
	for k, vs := range v {
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// isLiveKey reports whether key is a live-mode key.
func isLiveKey(key string) bool {
	return strings.HasPrefix(key, "sk_live_") || strings.HasPrefix(key, "rk_live_")
}

// maskKey masks an API key like Stripe does in its messages: the known
// prefix and the last four characters stay, the rest becomes ****.
func maskKey(key string) string {
	prefix := ""
	for _, p := range []string{"sk_test_", "sk_live_", "rk_test_", "rk_live_", "pk_test_", "pk_live_"} {
		if strings.HasPrefix(key, p) {
			prefix = p
			break
		}
	}
	rest := key[len(prefix):]
	if prefix == "" && len(rest) <= 8 || len(rest) <= 4 {
		return prefix + "****"
	}
	return prefix + "****" + rest[len(rest)-4:]
}
