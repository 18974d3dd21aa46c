package stripesim

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/stripe/stripe-go/v82/webhook"
)

// SampleShape is the shape of the request an error report's sample names.
type SampleShape int

// The sample shapes Stripe's pages and stripe-go have shown.
const (
	// SamplesRequest names the request as Stripe's example payload does:
	// {"id": "<Request-Id, or empty>", "idempotency_key": "<key>"}, the
	// key being the v1 request's Idempotency-Key (else the event's
	// identifier), and for the stream the event's identifier.
	SamplesRequest SampleShape = iota
	// SamplesIdentifier names it as stripe-go v82 decodes it and the
	// event object's example shows it: {"identifier": "<key>"}.
	SamplesIdentifier
	// SamplesRequestID names only the request: {"id": "<Request-Id>",
	// "idempotency_key": ""}, the worst case, in which a stream request's
	// id names up to 100 events.
	SamplesRequestID
)

// ListSupport is which parameters GET /v2/core/events takes.
type ListSupport int

// What GET /v2/core/events takes.
const (
	// ListFiltered takes types (types[0]=…, or repeated types=…),
	// created[gt|gte|lt|lte] (RFC 3339), object_id, limit and page, as
	// Stripe's newest API reference documents them.
	ListFiltered ListSupport = iota
	// ListUnfiltered refuses types and created with a 400 (unknown
	// parameter): only object_id, limit and page.
	ListUnfiltered
	// ListByObject requires object_id, as Stripe's earlier reference did,
	// and refuses types and created.
	ListByObject
)

// DefaultDeliveryRetries is how long Stripe retries an undelivered event:
// up to three days (docs.stripe.com/webhooks/process-undelivered-events).
const DefaultDeliveryRetries = 72 * time.Hour

// eventsPath is the v2 events endpoint.
const eventsPath = "/v2/core/events"

// eventRetention is how long events can be read and listed: "List events,
// going back up to 30 days" (stripe-go's V2CoreEventListParams; Stripe's
// List Events reference).
const eventRetention = 30 * 24 * time.Hour

// defaultEventsLimit is a list page's size without limit.
const defaultEventsLimit = 20

// thinEventJSON is the thin event Stripe posts to an event destination.
type thinEventJSON struct {
	ID            string         `json:"id"`
	Object        string         `json:"object"`
	Type          string         `json:"type"`
	Created       time.Time      `json:"created"`
	Livemode      bool           `json:"livemode"`
	Context       *string        `json:"context"`
	RelatedObject *relatedObject `json:"related_object,omitempty"`
}

type relatedObject struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	URL  string `json:"url"`
}

// eventJSON is the full v2 event GET /v2/core/events/{id} returns.
type eventJSON struct {
	thinEventJSON
	Data eventDataJSON `json:"data"`
}

type eventDataJSON struct {
	DeveloperMessageSummary string          `json:"developer_message_summary"`
	Reason                  eventReasonJSON `json:"reason"`
	ValidationStart         time.Time       `json:"validation_start"`
	ValidationEnd           time.Time       `json:"validation_end"`
}

type eventReasonJSON struct {
	ErrorCount int64           `json:"error_count"`
	ErrorTypes []errorTypeJSON `json:"error_types"`
}

type errorTypeJSON struct {
	Code         string            `json:"code"`
	ErrorCount   int64             `json:"error_count"`
	SampleErrors []sampleErrorJSON `json:"sample_errors"`
}

type sampleErrorJSON struct {
	ErrorMessage string `json:"error_message"`
	// Request is the request's fields of the sample's shape.
	Request map[string]string `json:"request"`
}

// maxSamples is how many sample errors an event carries, as Stripe's do.
const maxSamples = 20

func thinOf(r ErrorReport) thinEventJSON {
	t := thinEventJSON{ID: r.ID, Object: "v2.core.event", Type: r.Type, Created: r.Created.UTC(), Livemode: r.Livemode}
	if r.Context != "" {
		c := r.Context
		t.Context = &c
	}
	if r.Meter != "" {
		t.RelatedObject = &relatedObject{ID: r.Meter, Type: "billing.meter", URL: "/v1/billing/meters/" + r.Meter}
	}
	return t
}

// requestOf is the request sample i of r names, in shape.
func requestOf(r ErrorReport, i int, shape SampleShape) map[string]string {
	var id string
	if i < len(r.RequestIDs) {
		id = r.RequestIDs[i]
	}
	switch shape {
	case SamplesIdentifier:
		return map[string]string{"identifier": r.Identifiers[i]}
	case SamplesRequestID:
		return map[string]string{"id": id, "idempotency_key": ""}
	}
	return map[string]string{"id": id, "idempotency_key": r.Identifiers[i]}
}

func eventOf(r ErrorReport, shape SampleShape) eventJSON {
	e := eventJSON{thinEventJSON: thinOf(r)}
	et := errorTypeJSON{Code: r.Code, ErrorCount: int64(r.ErrorCount)}
	for i := range r.Identifiers {
		if i == maxSamples {
			break
		}
		et.SampleErrors = append(et.SampleErrors, sampleErrorJSON{ErrorMessage: r.Message, Request: requestOf(r, i, shape)})
	}
	e.Data = eventDataJSON{
		DeveloperMessageSummary: fmt.Sprintf("%d meter events for %s failed: %s", r.ErrorCount, r.EventName, r.Code),
		Reason:                  eventReasonJSON{ErrorCount: int64(r.ErrorCount), ErrorTypes: []errorTypeJSON{et}},
		ValidationStart:         r.Created.UTC().Truncate(time.Minute), ValidationEnd: r.Created.UTC().Truncate(time.Minute).Add(time.Minute),
	}
	return e
}

// eventsAccount is the account whose events a request reads: the one its
// Stripe-Context names, else the key's own. Stripe-Account alone does not
// name it: the simulator takes the worst plausible reading of "the
// authentication context needed to fetch the event" (docs/stripe.md).
func eventsAccount(c caller) string {
	if c.context != "" {
		return c.context
	}
	return c.own
}

// readable reports whether r can still be read or listed at now: of the
// caller's mode, and younger than eventRetention.
func readable(r ErrorReport, livemode bool, now time.Time) bool {
	return r.Livemode == livemode && now.Sub(r.Created) < eventRetention
}

// getEvent is GET /v2/core/events/{id}: one of the account's error reports
// as a full event.
func (s *Server) getEvent(w http.ResponseWriter, r *http.Request) {
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	var found *ErrorReport
	now := s.now()
	if a := s.accounts[eventsAccount(c)]; a != nil {
		for i := range a.reports {
			if a.reports[i].ID == id && readable(a.reports[i], c.livemode, now) {
				rep := a.reports[i]
				found = &rep
			}
		}
	}
	shape := s.samples
	s.mu.Unlock()
	if found == nil {
		writeError(w, errNoSuch(http.StatusNotFound, "event", "id", id))
		return
	}
	writeJSON(w, http.StatusOK, eventOf(*found, shape))
}

// eventsQuery is one listing of GET /v2/core/events: its filters, page size
// and, on a page after the first, where the previous page ended. A
// next_page_url carries it whole (page=…), as Stripe's do.
type eventsQuery struct {
	Types    []string   `json:"types,omitempty"`
	ObjectID string     `json:"object_id,omitempty"`
	Gt       *time.Time `json:"gt,omitempty"`
	Gte      *time.Time `json:"gte,omitempty"`
	Lt       *time.Time `json:"lt,omitempty"`
	Lte      *time.Time `json:"lte,omitempty"`
	Limit    int        `json:"limit"`
	// After is the last event of the previous page, newest first: its
	// created time and its index among the account's reports.
	AfterCreated *time.Time `json:"after_created,omitempty"`
	AfterIndex   int        `json:"after_index,omitempty"`
}

var typesIndexed = regexp.MustCompile(`^types\[\d+\]$`)

// parseEventsQuery reads the parameters of a listing, as support allows.
func parseEventsQuery(form map[string][]string, support ListSupport) (eventsQuery, *apiError) {
	if p, ok := form["page"]; ok {
		q, err := decodePage(p[0])
		if err != nil {
			return q, errValidation("", "page", "Invalid page: %s", p[0])
		}
		return q, nil
	}
	q := eventsQuery{Limit: defaultEventsLimit}
	keys := make([]string, 0, len(form))
	for k := range form {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		v := form[k][0]
		filter := false
		switch {
		case k == "limit":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 100 {
				return q, errValidation("", "limit", "Invalid limit: must be an integer between 1 and 100")
			}
			q.Limit = n
		case k == "object_id":
			q.ObjectID = v
		case k == "types" || typesIndexed.MatchString(k):
			q.Types = append(q.Types, form[k]...)
			filter = true
		case strings.HasPrefix(k, "created[") && strings.HasSuffix(k, "]"):
			t, err := time.Parse(time.RFC3339Nano, v)
			if err != nil {
				return q, errValidation("parameter_invalid_timestamp", k, "Invalid timestamp: %s", v)
			}
			switch k[len("created[") : len(k)-1] {
			case "gt":
				q.Gt = &t
			case "gte":
				q.Gte = &t
			case "lt":
				q.Lt = &t
			case "lte":
				q.Lte = &t
			default:
				return q, errUnknownParam(k)
			}
			filter = true
		default:
			return q, errUnknownParam(k)
		}
		if filter && support != ListFiltered {
			return q, errUnknownParam(k)
		}
	}
	if support == ListByObject && q.ObjectID == "" {
		return q, errMissingParam("object_id")
	}
	return q, nil
}

func encodePage(q eventsQuery) string {
	b, _ := json.Marshal(q)
	return base64.RawURLEncoding.EncodeToString(b)
}

func decodePage(p string) (eventsQuery, error) {
	var q eventsQuery
	b, err := base64.RawURLEncoding.DecodeString(p)
	if err == nil {
		err = json.Unmarshal(b, &q)
	}
	if err == nil && (q.Limit < 1 || q.Limit > 100) {
		err = fmt.Errorf("limit %d", q.Limit)
	}
	return q, err
}

// keeps reports whether report i, r, is in q's listing.
func (q eventsQuery) keeps(r ErrorReport, i int) bool {
	switch {
	case len(q.Types) > 0 && !slices.Contains(q.Types, r.Type),
		q.ObjectID != "" && q.ObjectID != r.Meter,
		q.Gt != nil && !r.Created.After(*q.Gt),
		q.Gte != nil && r.Created.Before(*q.Gte),
		q.Lt != nil && !r.Created.Before(*q.Lt),
		q.Lte != nil && r.Created.After(*q.Lte):
		return false
	case q.AfterCreated != nil:
		// Newest first: only what comes after the previous page's last.
		return r.Created.Before(*q.AfterCreated) || r.Created.Equal(*q.AfterCreated) && i < q.AfterIndex
	}
	return true
}

// eventsPage is a page of GET /v2/core/events.
type eventsPage struct {
	Data            []any   `json:"data"`
	NextPageURL     *string `json:"next_page_url"`
	PreviousPageURL *string `json:"previous_page_url"`
}

// listEvents is GET /v2/core/events: the error reports of the account the
// request's context names (else the key's own), of the key's mode, created
// in the last 30 days, newest first, filtered as Options.EventsList allows,
// a page at a time; next_page_url carries the rest of the listing.
func (s *Server) listEvents(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	s.mu.Lock()
	support, shape, thin := s.listing, s.samples, s.thinList
	s.mu.Unlock()
	q, e := parseEventsQuery(r.Form, support)
	if e != nil {
		writeError(w, e)
		return
	}
	type pos struct {
		rep ErrorReport
		i   int
	}
	var all []pos
	s.mu.Lock()
	now := s.now()
	if a := s.accounts[eventsAccount(c)]; a != nil {
		for i, rep := range a.reports {
			if readable(rep, c.livemode, now) && q.keeps(rep, i) {
				all = append(all, pos{rep, i})
			}
		}
	}
	s.mu.Unlock()
	slices.SortFunc(all, func(x, y pos) int {
		if d := y.rep.Created.Compare(x.rep.Created); d != 0 {
			return d
		}
		return y.i - x.i
	})
	page := eventsPage{Data: []any{}}
	for _, p := range all[:min(len(all), q.Limit)] {
		if thin {
			page.Data = append(page.Data, thinOf(p.rep))
		} else {
			page.Data = append(page.Data, eventOf(p.rep, shape))
		}
	}
	if len(all) > q.Limit {
		last := all[q.Limit-1]
		next := q
		next.AfterCreated, next.AfterIndex = &last.rep.Created, last.i
		u := eventsPath + "?page=" + encodePage(next)
		page.NextPageURL = &u
	}
	writeJSON(w, http.StatusOK, page)
}

// SignedThinEvent is the body and Stripe-Signature header of the thin
// event of report, signed with secret at t (stripe-go's test signer), as
// Stripe would post it.
func SignedThinEvent(report ErrorReport, secret string, t time.Time) (body []byte, signature string) {
	b, _ := json.Marshal(thinOf(report))
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: b, Secret: secret, Timestamp: t})
	return p.Payload, p.Header
}

// DeliverReports posts every error report of account not yet delivered to
// url as a signed thin event, like an event destination, and marks those
// answered 2xx delivered. A report that is not delivered is tried again on
// the next call until Options.DeliveryRetries (three days) have passed
// since it was created, by the simulator's clock; then it is abandoned and
// never posted again, as Stripe stops retrying: only a listing of
// GET /v2/core/events finds it. It returns how many were delivered and the
// first failure (a status other than 2xx, or none).
func (s *Server) DeliverReports(ctx context.Context, account, url, secret string) (int, error) {
	s.mu.Lock()
	a := s.accounts[account]
	now := s.now()
	var pending []ErrorReport
	if a != nil {
		for _, r := range a.reports {
			switch {
			case a.delivered[r.ID], a.abandoned[r.ID]:
			case now.Sub(r.Created) > s.retries:
				a.abandoned[r.ID] = true
			default:
				pending = append(pending, r)
			}
		}
	}
	s.mu.Unlock()
	n := 0
	var first error
	for _, r := range pending {
		body, sig := SignedThinEvent(r, secret, time.Now())
		if err := deliver(ctx, r.ID, url, body, sig); err != nil {
			if first == nil {
				first = err
			}
			if ctx.Err() != nil {
				break
			}
			continue
		}
		s.mu.Lock()
		a.delivered[r.ID] = true
		s.mu.Unlock()
		n++
	}
	return n, first
}

// deliver posts the signed body of event id to url once, as an event
// destination does; an answer other than 2xx is an error.
func deliver(ctx context.Context, id, url string, body []byte, sig string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Stripe-Signature", sig)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("stripesim: delivering %s: status %d", id, resp.StatusCode)
	}
	return nil
}

// Abandoned returns the ids of account's error reports that
// [Server.DeliverReports] gave up on, in creation order.
func (s *Server) Abandoned(account string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return nil
	}
	var out []string
	for _, r := range a.reports {
		if a.abandoned[r.ID] {
			out = append(out, r.ID)
		}
	}
	return out
}
