package api

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/reconcile"
)

// WebhookDeps are what POST /v1/stripe/events needs.
type WebhookDeps struct {
	// Secret is STRIPE_WEBHOOK_SECRET, the event destination's signing
	// secret.
	Secret string
	// Fetch reads the full event of a thin one from Stripe.
	Fetch func(ctx context.Context, id string) (stripeapi.MeterErrorReport, error)
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

// eventIDPattern is what a Stripe event id looks like (evt_ and letters,
// digits or underscores). The id is used to fetch the event from Stripe, so
// nothing else — a slash, a dot, a query — may reach that path.
var eventIDPattern = regexp.MustCompile(`^evt_[A-Za-z0-9_]{1,250}$`)

// maxWebhookBody bounds a thin event's body.
const maxWebhookBody = 64 << 10

// ThinEvent is what Tally reads of a thin event's body.
type ThinEvent struct {
	ID   string `json:"id"`
	Type string `json:"type"`
}

type signatureError struct{ msg string }

func (e *signatureError) Error() string { return e.msg }

// ParseStripeEvent verifies body against its Stripe-Signature header with
// the signing secret (stripe-go's webhook package, 300 s tolerance; a
// signature dated more than 300 s ahead is refused too) and reads the thin
// event: an id of Stripe's shape and a type, or an error.
func ParseStripeEvent(body []byte, signature, secret string) (ThinEvent, error) {
	if err := webhook.ValidatePayloadWithTolerance(body, signature, secret, webhookTolerance); err != nil {
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
	var thin ThinEvent
	if err := json.Unmarshal(body, &thin); err != nil || !eventIDPattern.MatchString(thin.ID) || thin.Type == "" || len(thin.Type) > 200 {
		return ThinEvent{}, errors.New("the body is not a Stripe thin event")
	}
	return thin, nil
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
// answers 400 and records nothing; a meter error report is fetched in full
// and recorded once, however often it is delivered, and the accepted items
// it names are quarantined or rejected (T10) in the same transaction;
// other types are acknowledged and ignored.
func (h *handlers) stripeEvents(w http.ResponseWriter, r *http.Request) {
	if h.Webhook == nil || h.Webhook.Secret == "" || h.Webhook.Fetch == nil {
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
	switch thin.Type {
	case stripeapi.EventMeterErrorReport, stripeapi.EventNoMeterFound:
	default:
		writeJSON(w, http.StatusOK, map[string]string{"status": "ignored"})
		return
	}
	seen, err := reconcile.EventRecorded(r.Context(), h.Pool, thin.ID)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if seen {
		writeJSON(w, http.StatusOK, map[string]string{"status": "duplicate"})
		return
	}
	rep, err := h.Webhook.Fetch(r.Context(), thin.ID)
	if err != nil {
		// Stripe delivers again later.
		code, status, _ := stripeapi.Describe(err)
		h.log.WarnContext(r.Context(), "fetching a Stripe event failed", "event", thin.ID, "code", code, "status", status)
		WriteError(w, http.StatusBadGateway, "event_unavailable", "the event could not be read from Stripe; deliver it again later")
		return
	}
	res, err := reconcile.RecordReport(r.Context(), h.Pool, h.Outbox, rep)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if !res.Recorded {
		writeJSON(w, http.StatusOK, map[string]string{"status": "duplicate"})
		return
	}
	h.log.InfoContext(r.Context(), "Stripe meter error report recorded", "event", rep.ID, "type", rep.Type,
		"failed", res.Failed, "noted", res.Noted, "evidence_only", res.EvidenceOnly, "unmatched", res.Unmatched)
	writeJSON(w, http.StatusOK, stripeEventAnswer{Status: "recorded", Failed: res.Failed, Noted: res.Noted,
		EvidenceOnly: res.EvidenceOnly, Unmatched: res.Unmatched})
}

// stripeEventAnswer is the answer to a meter error report recorded now:
// how many of the items it names it moved from accepted (T10: quarantined
// or rejected), how many it only recorded evidence against (they were in
// another state), and how many of its identifiers no item has.
type stripeEventAnswer struct {
	Status       string `json:"status"`
	Failed       int    `json:"failed"`
	Noted        int    `json:"noted"`
	EvidenceOnly int    `json:"evidence_only"`
	Unmatched    int    `json:"unmatched"`
}
