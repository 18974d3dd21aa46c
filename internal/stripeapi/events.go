package stripeapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/stripe/stripe-go/v82"
)

// The event types of meter error reports.
const (
	EventMeterErrorReport = "v1.billing.meter.error_report_triggered"
	EventNoMeterFound     = "v1.billing.meter.no_meter_found"
)

// EventsPath is the path of Stripe's v2 events: GET lists them, GET
// EventsPath/{id} reads one.
const EventsPath = "/v2/core/events"

// The v1 events Stripe sends about a meter (stripe-go's
// EventTypeBillingMeter*): an event destination with the snapshot payload
// style posts them with the meter in data.object, and "account" on a
// connected account's.
const (
	EventMeterCreated     = "billing.meter.created"
	EventMeterUpdated     = "billing.meter.updated"
	EventMeterDeactivated = "billing.meter.deactivated"
	EventMeterReactivated = "billing.meter.reactivated"
)

// MeterStatusEvent reports whether typ is a v1 event about a meter's
// existence or status.
func MeterStatusEvent(typ string) bool {
	switch typ {
	case EventMeterCreated, EventMeterUpdated, EventMeterDeactivated, EventMeterReactivated:
		return true
	}
	return false
}

// The v1 events Stripe sends about a customer's subscription (stripe-go's
// EventTypeCustomerSubscription*), with the subscription in data.object.
const (
	EventSubscriptionCreated = "customer.subscription.created"
	EventSubscriptionUpdated = "customer.subscription.updated"
	EventSubscriptionDeleted = "customer.subscription.deleted"
)

// SubscriptionEvent reports whether typ is a v1 event about a customer's
// subscription that can change its billing periods.
func SubscriptionEvent(typ string) bool {
	switch typ {
	case EventSubscriptionCreated, EventSubscriptionUpdated, EventSubscriptionDeleted:
		return true
	}
	return false
}

// The v1 events Stripe sends about an invoice (stripe-go's
// EventTypeInvoice*), with the invoice in data.object.
const (
	EventInvoiceCreated   = "invoice.created"
	EventInvoiceFinalized = "invoice.finalized"
	EventInvoiceUpdated   = "invoice.updated"
)

// InvoiceEvent reports whether typ is a v1 event about an invoice that
// Tally reads the invoice again for.
func InvoiceEvent(typ string) bool {
	switch typ {
	case EventInvoiceCreated, EventInvoiceFinalized, EventInvoiceUpdated:
		return true
	}
	return false
}

// ValidInvoiceID reports whether id has the shape of a Stripe invoice id
// (in_ then letters and digits).
func ValidInvoiceID(id string) bool { return validID(id, "in_") }

// ValidCustomerID reports whether id has the shape of a Stripe customer id
// (cus_ then letters and digits).
func ValidCustomerID(id string) bool { return validID(id, "cus_") }

// validID reports whether id is prefix then 1 to 250 letters and digits.
func validID(id, prefix string) bool {
	rest, ok := strings.CutPrefix(id, prefix)
	if !ok || rest == "" || len(rest) > 250 {
		return false
	}
	return !strings.ContainsFunc(rest, func(r rune) bool {
		return (r < '0' || r > '9') && (r < 'a' || r > 'z') && (r < 'A' || r > 'Z')
	})
}

// EventRetention is how long Stripe keeps an event readable and listable:
// "List events, going back up to 30 days" (stripe-go's
// V2CoreEventListParams; docs/stripe.md).
const EventRetention = 30 * 24 * time.Hour

// Event is a v2 event as Tally reads it: a thin event's envelope, and the
// data Stripe adds when the event is fetched or listed.
type Event struct {
	ID, Type string
	Livemode bool
	Created  time.Time
	// Context is "the authentication context needed to fetch the event or
	// related object" (stripe-go's V2BaseEvent.Context): empty for the
	// key's own account, else a path of account ids ("acct_…", or
	// "acct_…/acct_…" below an organization), sent as Stripe-Context.
	Context string
	// RelatedObject is the id of the related object (a meter); empty when
	// there is none.
	RelatedObject string
	// Data is the event's data as Stripe sent it; nil when the event came
	// without it (a thin event).
	Data json.RawMessage
}

// ContextAccount is the account a context names: its last account id, the
// account the request acts as; "" for no context (the key's own account).
func ContextAccount(context string) string {
	return context[strings.LastIndexByte(context, '/')+1:]
}

// contextPattern is what Tally sends as Stripe-Context: up to five ids of
// letters, digits and underscores, separated by slashes (Stripe's
// documented formats are "acct_…" and "acct_…/acct_…").
var contextPattern = regexp.MustCompile(`^[A-Za-z0-9_]{1,100}(/[A-Za-z0-9_]{1,100}){0,4}$`)

// ValidContext reports whether context is empty or may be sent as
// Stripe-Context.
func ValidContext(context string) bool {
	return context == "" || contextPattern.MatchString(context)
}

// eventIDPattern is what a Stripe event id looks like (evt_ and letters,
// digits or underscores): nothing else — a slash, a dot, a query — may
// reach the path it is read from.
var eventIDPattern = regexp.MustCompile(`^evt_[A-Za-z0-9_]{1,250}$`)

// ValidEventID reports whether id has the shape of a Stripe event id.
func ValidEventID(id string) bool { return eventIDPattern.MatchString(id) }

// Event reads the full event id (GET /v2/core/events/{id}) in the context
// its thin event named: Stripe-Context: stripeContext when it is set — and
// then no Stripe-Account, which the context supersedes
// (docs.stripe.com/context) —, else as every other call of the client
// (Stripe-Account: Config.Account when set). Failures are *Error, with the
// HTTP status, which stripe-go v82 does not give for v2 errors.
func (c *Client) Event(ctx context.Context, id, stripeContext string) (Event, error) {
	if !ValidEventID(id) {
		return Event{}, configError("a Stripe event id is evt_ and letters, digits or underscores")
	}
	if !ValidContext(stripeContext) {
		return Event{}, configError("a Stripe-Context is account ids separated by slashes")
	}
	raw := &stripe.V2RawEvent{}
	if err := c.getV2(ctx, EventsPath+"/"+id, stripeContext, &stripe.Params{}, raw); err != nil {
		return Event{}, err
	}
	return eventOf(raw), nil
}

// EventList are the parameters of the first page of a listing of events.
type EventList struct {
	// Types, when set, are sent as types[0], types[1], … (the indexed
	// encoding stripe-go uses for v2 arrays from v83.1).
	Types []string
	// CreatedAfter, when set, is sent as created[gt], in RFC 3339 (the
	// reference's "timestamp", date-time in Stripe's OpenAPI).
	CreatedAfter time.Time
	// ObjectID, when set, is sent as object_id: the events of that object
	// (a meter) alone.
	ObjectID string
	// Limit, when set, is sent as limit, the page size.
	Limit int
}

// EventPage is one page of a listing, newest first.
type EventPage struct {
	Events []Event
	// Next is the page after this one (Stripe's next_page_url, a path of
	// EventsPath with the listing's parameters in its query); empty on the
	// last page.
	Next string
}

// ListEvents reads one page of the events of the account stripeContext
// names (else the client's, as Event does): the first, with q's
// parameters, when next is empty, else the page next names (an
// EventPage.Next, which carries the listing's parameters). Stripe lists
// v2 events newest first and keeps them 30 days.
func (c *Client) ListEvents(ctx context.Context, stripeContext string, q EventList, next string) (EventPage, error) {
	if !ValidContext(stripeContext) {
		return EventPage{}, configError("a Stripe-Context is account ids separated by slashes")
	}
	path, p := EventsPath, &stripe.Params{}
	if next != "" {
		// Only a page of this listing, on this host.
		if !strings.HasPrefix(next, EventsPath+"?") || strings.ContainsAny(next, "#\r\n ") {
			return EventPage{}, &Error{Code: CodeBadResponse, message: "Stripe's next page is not a page of the events"}
		}
		path = next
	} else {
		for i, t := range q.Types {
			p.AddExtra("types["+strconv.Itoa(i)+"]", t)
		}
		if !q.CreatedAfter.IsZero() {
			p.AddExtra("created[gt]", q.CreatedAfter.UTC().Format(time.RFC3339Nano))
		}
		if q.ObjectID != "" {
			p.AddExtra("object_id", q.ObjectID)
		}
		if q.Limit > 0 {
			p.AddExtra("limit", strconv.Itoa(q.Limit))
		}
	}
	page := &stripe.V2Page[stripe.V2RawEvent]{}
	if err := c.getV2(ctx, path, stripeContext, p, page); err != nil {
		return EventPage{}, err
	}
	out := EventPage{Next: page.NextPageURL}
	for i := range page.Data {
		out.Events = append(out.Events, eventOf(&page.Data[i]))
	}
	return out, nil
}

// getV2 sends GET path with p, in stripeContext (Stripe-Context, no
// Stripe-Account) or, without one, as the client's other calls, and
// decodes the answer into v.
func (c *Client) getV2(ctx context.Context, path, stripeContext string, p *stripe.Params, v stripe.LastResponseSetter) error {
	ctx, resp := WithResponse(ctx)
	p.Context = ctx
	if stripeContext != "" {
		p.SetStripeContext(stripeContext)
	} else if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	err := c.backends.API.Call(http.MethodGet, path, c.key, p, v)
	if err == nil {
		return nil
	}
	e := wrap(err)
	if e.HTTPStatus == 0 && resp.Status != 0 {
		// stripe-go v82 gives v2 errors without their status.
		e.HTTPStatus, e.RequestID = resp.Status, resp.RequestID
	}
	return e
}

func eventOf(raw *stripe.V2RawEvent) Event {
	e := Event{ID: raw.ID, Type: raw.Type, Livemode: raw.Livemode, Created: raw.Created, Context: raw.Context}
	if raw.RelatedObject != nil {
		e.RelatedObject = raw.RelatedObject.ID
	}
	if raw.Data != nil && string(*raw.Data) != "null" {
		e.Data = json.RawMessage(*raw.Data)
	}
	return e
}

// MeterErrorReport is a v1.billing.meter.error_report_triggered or
// v1.billing.meter.no_meter_found event, as Tally records it.
type MeterErrorReport struct {
	ID, Type string
	Livemode bool
	Created  time.Time
	// Context is the event's context (Event.Context).
	Context string
	// Meter is the related meter; empty for no_meter_found.
	Meter string
	// Samples are the failed events Stripe names (a sample, not all of
	// them: ErrorCount says how many failed).
	Samples    []MeterErrorSample
	ErrorCount int64
}

// MeterErrorSample is one failed meter event of a report, and what the
// sample's request names it by: Stripe has shown request.identifier
// (stripe-go v82's only field, "The request idempotency key"), and
// request.id with request.idempotency_key (its example payload); any may be
// empty.
type MeterErrorSample struct {
	// Identifier is request.identifier.
	Identifier string
	// IdempotencyKey is request.idempotency_key.
	IdempotencyKey string
	// RequestID is request.id, the Request-Id of the request that carried
	// the event: a v1 call carries one event, a stream request up to 100.
	RequestID string
	// Code is the error type's code; Message the sample's message,
	// sanitised.
	Code, Message string
}

// Names reports whether the sample names its request at all.
func (s MeterErrorSample) Names() bool {
	return s.Identifier != "" || s.IdempotencyKey != "" || s.RequestID != ""
}

// reportData is the data of a meter error report, read raw: stripe-go v82
// decodes only request.identifier of a sample.
type reportData struct {
	Reason *struct {
		ErrorCount int64 `json:"error_count"`
		ErrorTypes []*struct {
			Code         string `json:"code"`
			SampleErrors []*struct {
				ErrorMessage string `json:"error_message"`
				Request      *struct {
					Identifier     string `json:"identifier"`
					IdempotencyKey string `json:"idempotency_key"`
					ID             string `json:"id"`
				} `json:"request"`
			} `json:"sample_errors"`
		} `json:"error_types"`
	} `json:"reason"`
}

// ErrNoData says an event came without its data: fetch it (Client.Event).
var ErrNoData = errors.New("stripeapi: the event came without its data")

// ParseMeterErrorReport reads a meter error report from its full event:
// each sample with what its request names (identifier, idempotency_key,
// id; unknown fields are ignored, and a sample whose request names nothing
// is left out). An event of another type, or data Tally cannot read, is an
// *Error (CodeBadResponse); an event without data is ErrNoData. Messages
// are sanitised; a name longer than 255 characters or holding control
// characters is dropped.
func ParseMeterErrorReport(ev Event) (MeterErrorReport, error) {
	if ev.Type != EventMeterErrorReport && ev.Type != EventNoMeterFound {
		return MeterErrorReport{}, &Error{Code: CodeBadResponse, message: "the event is not a meter error report"}
	}
	if len(ev.Data) == 0 {
		return MeterErrorReport{}, ErrNoData
	}
	var d reportData
	if err := json.Unmarshal(ev.Data, &d); err != nil {
		return MeterErrorReport{}, &Error{Code: CodeBadResponse, message: "the meter error report's data could not be read"}
	}
	out := MeterErrorReport{ID: ev.ID, Type: ev.Type, Livemode: ev.Livemode, Created: ev.Created, Context: ev.Context}
	if ev.Type == EventMeterErrorReport {
		out.Meter = name(ev.RelatedObject)
	}
	if d.Reason == nil {
		return out, nil
	}
	out.ErrorCount = d.Reason.ErrorCount
	for _, t := range d.Reason.ErrorTypes {
		if t == nil {
			continue
		}
		for _, s := range t.SampleErrors {
			if s == nil || s.Request == nil {
				continue
			}
			sample := MeterErrorSample{Identifier: name(s.Request.Identifier), IdempotencyKey: name(s.Request.IdempotencyKey),
				RequestID: name(s.Request.ID), Code: sanitize(t.Code), Message: sanitize(s.ErrorMessage)}
			if sample.Names() {
				out.Samples = append(out.Samples, sample)
			}
		}
	}
	return out, nil
}

// name is s when it can name a request or an event: at most 255
// characters (Stripe's bound on idempotency keys), no control characters
// or spaces; else "".
func name(s string) string {
	if len(s) > 255 || strings.IndexFunc(s, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) }) >= 0 {
		return ""
	}
	return s
}

// MeterErrorEvent fetches the full event id with the client's own account
// (Event without a context) and reads it as a meter error report
// (ParseMeterErrorReport).
func (c *Client) MeterErrorEvent(ctx context.Context, id string) (MeterErrorReport, error) {
	ev, err := c.Event(ctx, id, "")
	if err != nil {
		return MeterErrorReport{}, err
	}
	return ParseMeterErrorReport(ev)
}

// BillingEvent is a v1 event about a subscription or an invoice, as a
// listing gives it: what it is about, and when it happened.
type BillingEvent struct {
	ID, Type string
	Created  time.Time
	// Customer and Object are data.object's customer and id.
	Customer, Object string
}

// billingEventTypes are the types BillingEvents lists.
var billingEventTypes = []string{EventSubscriptionCreated, EventSubscriptionUpdated, EventSubscriptionDeleted,
	EventInvoiceCreated, EventInvoiceFinalized, EventInvoiceUpdated}

// BillingEvents lists the client's account's subscription and invoice
// events created at or after since, oldest first ("List events, going
// back up to 30 days"; the list itself is newest first).
func (c *Client) BillingEvents(ctx context.Context, since time.Time) ([]BillingEvent, error) {
	p := &stripe.EventListParams{CreatedRange: &stripe.RangeQueryParams{GreaterThanOrEqual: since.Unix()}}
	for _, t := range billingEventTypes {
		p.Types = append(p.Types, stripe.String(t))
	}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	var out []BillingEvent
	for ev, err := range c.sc.V1Events.List(ctx, p) {
		if err != nil {
			return nil, WrapError(err)
		}
		be := BillingEvent{ID: ev.ID, Type: string(ev.Type), Created: unixTime(ev.Created)}
		if ev.Data != nil {
			be.Object, _ = ev.Data.Object["id"].(string)
			be.Customer, _ = ev.Data.Object["customer"].(string)
		}
		out = append(out, be)
	}
	slices.Reverse(out)
	return out, nil
}
