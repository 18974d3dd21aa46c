package api

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/reconcile"
)

// WebhookDeps are what POST /v1/stripe/events needs.
type WebhookDeps struct {
	// Secret is STRIPE_WEBHOOK_SECRET, the event destination's signing
	// secret.
	Secret string
	// Events records Stripe's events; nil without a key.
	Events *reconcile.Events
	// Fetch reads the full event of a thin one from Stripe, in its
	// context (stripeapi.Client.Event).
	Fetch reconcile.Fetcher
	// Subscriptions reads at once the subscriptions of the customer a
	// customer.subscription.* event is about, in every account a tenant
	// maps it in, and says in how many (mappings.Store.SyncCustomer); nil:
	// such events are ignored, and the hourly job reads them.
	Subscriptions func(ctx context.Context, db pgdb.Beginner, customer string) (int, error)
	// Invoices reads at once the invoice an invoice.* event is about, of
	// its customer, in every account a tenant maps the customer in, and
	// says in how many it was recorded (invoices.Receive); nil: such
	// events are ignored.
	Invoices func(ctx context.Context, db pgdb.Beginner, customer, invoice string) (int, error)
	// Meters reads at once the meters of the account a billing.meter.*
	// event is about ("": the key's own) and reports whether Tally
	// exports to it (reconcile.Backfill.MetersChanged); nil: such events
	// are ignored, and the hourly listing reads the meters.
	Meters func(ctx context.Context, db pgdb.DB, account string) (bool, error)
}

// stripeEventsPath is the event destination's route under /v1.
const stripeEventsPath = "/stripe/events"

// webhookTolerance is how old a signature may be (Stripe's default).
const webhookTolerance = 300 * time.Second

// webhookSkew is how far in the future a signature's timestamp may be: the
// clocks of Stripe and of this node may differ a little, never by a year.
// stripe-go's check bounds only the age, so a future-dated signature would
// otherwise stay valid until its date plus the tolerance.
const webhookSkew = 300 * time.Second

// maxWebhookBody bounds a thin event's body.
const maxWebhookBody = 64 << 10

// ThinEvent is what Tally reads of the body of one of Stripe's events: a
// thin event (object v2.core.event), or a v1 event in the snapshot style
// (object event).
type ThinEvent struct {
	ID   string
	Type string
	// Object is the body's object: "v2.core.event" for a thin event,
	// "event" for a v1 snapshot event.
	Object string
	// Account is a v1 snapshot event's connected account ("account"),
	// empty for the key's own.
	Account string
	// Created is the event's creation time; zero when the body has none
	// Tally can read.
	Created  time.Time
	Livemode bool
	// Customer is the customer of a v1 snapshot event's object
	// (data.object.customer), when it names one.
	Customer string
	// ObjectID is the id of a v1 snapshot event's object (data.object.id).
	ObjectID string
	// Context is "the authentication context needed to fetch the event"
	// (Stripe's event types reference): the account the event is about,
	// empty (null) for the key's own account.
	Context string
}

// thinJSON is a thin event's body as Stripe posts it.
type thinJSON struct {
	ID     string `json:"id"`
	Type   string `json:"type"`
	Object string `json:"object"`
	// Created is RFC 3339 text in a thin event, Unix seconds in a v1 one.
	Created  json.RawMessage `json:"created"`
	Livemode bool            `json:"livemode"`
	Context  *string         `json:"context"`
	Account  *string         `json:"account"`
	Data     *struct {
		Object struct {
			ID       string          `json:"id"`
			Customer json.RawMessage `json:"customer"`
		} `json:"object"`
	} `json:"data"`
}

// snapshotObject is the object of a v1 event.
const snapshotObject = "event"

// event is the thin event as package reconcile receives it.
func (t ThinEvent) event() stripeapi.Event {
	return stripeapi.Event{ID: t.ID, Type: t.Type, Created: t.Created, Livemode: t.Livemode, Context: t.Context}
}

type signatureError struct{ msg string }

func (e *signatureError) Error() string { return e.msg }

// ParseStripeEvent verifies body against its Stripe-Signature header with
// the signing secret (stripe-go's webhook package, 300 s tolerance; a
// signature dated more than 300 s ahead is refused too) and reads the thin
// event: an id of Stripe's shape and a type, or an error; its created time
// (RFC 3339; zero when unreadable), livemode and context besides.
func ParseStripeEvent(body []byte, signature, secret string) (ThinEvent, error) {
	if err := verifySignature(body, signature, secret); err != nil {
		msg := "the Stripe-Signature header does not match the body with the signing secret"
		if errors.Is(err, webhook.ErrTooOld) {
			msg = "the signature is older than 300 seconds"
		} else if errors.Is(err, webhook.ErrNotSigned) || errors.Is(err, webhook.ErrInvalidHeader) {
			msg = "the Stripe-Signature header is missing or malformed"
		}
		return ThinEvent{}, &signatureError{msg}
	}
	if at, ok := signedAt(signature); !ok || time.Until(at) > webhookSkew {
		return ThinEvent{}, &signatureError{"the signature is dated in the future"}
	}
	var raw thinJSON
	if err := json.Unmarshal(body, &raw); err != nil || !stripeapi.ValidEventID(raw.ID) || raw.Type == "" || len(raw.Type) > 200 {
		return ThinEvent{}, errors.New("the body is not a Stripe thin event")
	}
	thin := ThinEvent{ID: raw.ID, Type: raw.Type, Object: raw.Object, Livemode: raw.Livemode}
	if raw.Context != nil {
		thin.Context = *raw.Context
	}
	if raw.Account != nil {
		thin.Account = *raw.Account
	}
	if raw.Data != nil {
		thin.ObjectID = raw.Data.Object.ID
		// An id; an expanded customer is an object, whose id is enough.
		var c struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(raw.Data.Object.Customer, &thin.Customer) != nil && json.Unmarshal(raw.Data.Object.Customer, &c) == nil {
			thin.Customer = c.ID
		}
	}
	var text string
	var unix int64
	if json.Unmarshal(raw.Created, &text) == nil {
		if t, err := time.Parse(time.RFC3339Nano, text); err == nil {
			thin.Created = t
		}
	} else if json.Unmarshal(raw.Created, &unix) == nil {
		thin.Created = time.Unix(unix, 0).UTC()
	}
	return thin, nil
}

// verifySignature checks body's signature with each of the signing
// secrets, separated by commas (one per event destination posting here:
// a thin one and a snapshot one each have their own); the error is the
// last secret's when none matches.
func verifySignature(body []byte, signature, secrets string) error {
	var err error
	for _, secret := range strings.Split(secrets, ",") {
		if err = webhook.ValidatePayloadWithTolerance(body, signature, strings.TrimSpace(secret), webhookTolerance); err == nil {
			return nil
		}
	}
	return err
}

// signedAt reads the timestamp (t=) of a Stripe-Signature header that has
// already been verified, exactly as stripe-go's webhook package reads it
// (pairs split on "," and "=", no trimming), so that the time checked here
// is the time the signature covers. A header with no t= or more than one is
// refused: stripe-go would take the last, and a first one could then claim
// another time than the signed one.
func signedAt(header string) (time.Time, bool) {
	var (
		at    time.Time
		found int
	)
	for _, pair := range strings.Split(header, ",") {
		k, v, ok := strings.Cut(pair, "=")
		if !ok || k != "t" {
			continue
		}
		sec, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return time.Time{}, false
		}
		at, found = time.Unix(sec, 0), found+1
	}
	return at, found == 1
}

// stripeEvents receives Stripe's thin events. A bad or stale signature
// answers 400 and records nothing. An event of a type Tally records is
// received through package reconcile (Events.Receive) — read in full in
// its context and recorded once, however often it is delivered; a meter
// error report moves the accepted items it names out of accepted in the same
// transaction — and answered 2xx whatever came of it: recorded, a
// duplicate, about an account Tally does not export to (foreign), or
// refused to Tally by Stripe (unreadable, read again by the listing). Only
// a read of the event that got no usable answer is a 502, for Stripe to
// deliver it again. Other types are acknowledged and ignored.
func (h *handlers) stripeEvents(w http.ResponseWriter, r *http.Request) {
	if h.Webhook == nil || h.Webhook.Secret == "" || h.Webhook.Events == nil || h.Webhook.Fetch == nil {
		WriteError(w, http.StatusServiceUnavailable, "webhooks_not_configured", "STRIPE_WEBHOOK_SECRET and STRIPE_API_KEY are required to receive Stripe's events")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxWebhookBody))
	if err != nil {
		WriteError(w, http.StatusRequestEntityTooLarge, "too_large", "the event is larger than 64 KiB")
		return
	}
	thin, err := ParseStripeEvent(body, r.Header.Get("Stripe-Signature"), h.Webhook.Secret)
	var se *signatureError
	switch {
	case errors.As(err, &se):
		WriteError(w, http.StatusBadRequest, "invalid_signature", se.msg)
		return
	case err != nil:
		WriteError(w, http.StatusBadRequest, "invalid_event", "the body is not a Stripe thin event")
		return
	}
	if thin.Object == snapshotObject {
		h.snapshotEvent(w, r, thin)
		return
	}
	rec, err := h.Webhook.Events.Receive(r.Context(), h.Pool, thin.event(), h.Webhook.Fetch, reconcile.ArrivalDestination)
	var unavailable *reconcile.UnavailableError
	switch {
	case errors.As(err, &unavailable):
		WriteError(w, http.StatusBadGateway, "event_unavailable", "the event could not be read from Stripe; deliver it again later")
		return
	case err != nil:
		h.internal(w, r, err)
		return
	}
	answer := stripeEventAnswer{Status: rec.Status}
	if rec.Status == reconcile.ReceiptRecorded {
		res := rec.Report
		answer.Failed, answer.Noted, answer.EvidenceOnly, answer.Unmatched = &res.Failed, &res.Noted, &res.EvidenceOnly, &res.Unmatched
	}
	writeJSON(w, http.StatusOK, answer)
}

// snapshotEvent receives a v1 event in the snapshot style: a
// billing.meter.* event makes Tally read that account's meters at once
// (its items pause or resume, and accepts record the new meter), which is
// all it takes from the event — the snapshot may be older than the meter —
// and every other type is ignored. Stripe failing that read is a 502, for
// Stripe to deliver the event again (the hourly listing reads the meters
// anyway).
func (h *handlers) snapshotEvent(w http.ResponseWriter, r *http.Request, ev ThinEvent) {
	if stripeapi.SubscriptionEvent(ev.Type) {
		h.subscriptionEvent(w, r, ev)
		return
	}
	if stripeapi.InvoiceEvent(ev.Type) {
		h.invoiceEvent(w, r, ev)
		return
	}
	if !stripeapi.MeterStatusEvent(ev.Type) || h.Webhook.Meters == nil {
		writeJSON(w, http.StatusOK, stripeEventAnswer{Status: reconcile.ReceiptIgnored})
		return
	}
	ours, err := h.Webhook.Meters(r.Context(), h.Pool, ev.Account)
	switch {
	case errors.Is(err, reconcile.ErrMetersUnread):
		h.log.WarnContext(r.Context(), "reading the meters a Stripe event is about failed; Stripe delivers it again",
			"event", ev.ID, "type", ev.Type)
		WriteError(w, http.StatusBadGateway, "event_unavailable", "the meters could not be read from Stripe; deliver the event again later")
		return
	case err != nil:
		h.internal(w, r, err)
		return
	case !ours:
		writeJSON(w, http.StatusOK, stripeEventAnswer{Status: reconcile.ReceiptForeign})
		return
	}
	h.log.InfoContext(r.Context(), "a Stripe meter changed: the account's meters were read again", "event", ev.ID, "type", ev.Type)
	writeJSON(w, http.StatusOK, stripeEventAnswer{Status: statusMetersRead})
}

// subscriptionEvent receives a customer.subscription.* event: Tally reads
// the customer's subscriptions again at once (the snapshot may be older
// than the subscription), and the tenants mapped to it bill by their
// periods (the hourly job reads them anyway).
func (h *handlers) subscriptionEvent(w http.ResponseWriter, r *http.Request, ev ThinEvent) {
	if h.Webhook.Subscriptions == nil || !stripeapi.ValidCustomerID(ev.Customer) {
		writeJSON(w, http.StatusOK, stripeEventAnswer{Status: reconcile.ReceiptIgnored})
		return
	}
	h.readAtOnce(w, r, ev, "subscriptions", statusSubscriptionsRead, func() (int, error) {
		return h.Webhook.Subscriptions(r.Context(), h.Pool, ev.Customer)
	}, func(err error) bool {
		var unavailable *mappings.ErrProviderUnavailable
		var account *mappings.AccountError
		return errors.As(err, &unavailable) || errors.As(err, &account)
	})
}

// invoiceEvent receives an invoice.* event: Tally reads the invoice again
// at once, with its lines, and keeps it.
func (h *handlers) invoiceEvent(w http.ResponseWriter, r *http.Request, ev ThinEvent) {
	if h.Webhook.Invoices == nil || !stripeapi.ValidCustomerID(ev.Customer) || !stripeapi.ValidInvoiceID(ev.ObjectID) {
		writeJSON(w, http.StatusOK, stripeEventAnswer{Status: reconcile.ReceiptIgnored})
		return
	}
	h.readAtOnce(w, r, ev, "invoice", statusInvoiceRead, func() (int, error) {
		return h.Webhook.Invoices(r.Context(), h.Pool, ev.Customer, ev.ObjectID)
	}, func(err error) bool {
		var se *stripeapi.Error
		return errors.As(err, &se)
	})
}

// readAtOnce answers an event by reading what it is about (read, which
// says in how many accounts): status when it was read, foreign when no
// tenant maps its customer, and a 502 when Stripe failed the read
// (unavailable), for Stripe to deliver the event again.
func (h *handlers) readAtOnce(w http.ResponseWriter, r *http.Request, ev ThinEvent, what, status string,
	read func() (int, error), unavailable func(error) bool) {
	n, err := read()
	switch {
	case err != nil && unavailable(err):
		h.log.WarnContext(r.Context(), "reading the "+what+" a Stripe event is about failed; Stripe delivers it again",
			"event", ev.ID, "type", ev.Type)
		WriteError(w, http.StatusBadGateway, "event_unavailable", "the "+what+" could not be read from Stripe; deliver the event again later")
		return
	case err != nil:
		h.internal(w, r, err)
		return
	case n == 0:
		writeJSON(w, http.StatusOK, stripeEventAnswer{Status: reconcile.ReceiptForeign})
		return
	}
	writeJSON(w, http.StatusOK, stripeEventAnswer{Status: status})
}

// statusInvoiceRead answers an invoice.* event after which the invoice was
// read and kept.
const statusInvoiceRead = "invoice_read"

// statusSubscriptionsRead answers a customer.subscription.* event after
// which the customer's subscriptions were read.
const statusSubscriptionsRead = "subscriptions_read"

// statusMetersRead answers a billing.meter.* event after which the
// account's meters were read.
const statusMetersRead = "meters_read"

// stripeEventAnswer is the answer to one of Stripe's events: what came of
// it (reconcile.Receipt's status) and, for a meter error report recorded
// now, how many of the items it names it moved from accepted (to
// quarantined or rejected), how many it only recorded evidence against
// (they were in another state), and how many of its identifiers no item
// has.
type stripeEventAnswer struct {
	Status       string `json:"status"`
	Failed       *int   `json:"failed,omitempty"`
	Noted        *int   `json:"noted,omitempty"`
	EvidenceOnly *int   `json:"evidence_only,omitempty"`
	Unmatched    *int   `json:"unmatched,omitempty"`
}
