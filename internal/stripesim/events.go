package stripesim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/stripe/stripe-go/v82/webhook"
)

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
	Request      struct {
		Identifier string `json:"identifier"`
	} `json:"request"`
}

// maxSamples is how many sample errors an event carries, as Stripe's do.
const maxSamples = 20

func thinOf(r ErrorReport) thinEventJSON {
	t := thinEventJSON{ID: r.ID, Object: "v2.core.event", Type: r.Type, Created: r.Created.UTC(), Livemode: r.Livemode}
	if r.Meter != "" {
		t.RelatedObject = &relatedObject{ID: r.Meter, Type: "billing.meter", URL: "/v1/billing/meters/" + r.Meter}
	}
	return t
}

func eventOf(r ErrorReport) eventJSON {
	e := eventJSON{thinEventJSON: thinOf(r)}
	et := errorTypeJSON{Code: r.Code, ErrorCount: int64(r.ErrorCount)}
	for i, id := range r.Identifiers {
		if i == maxSamples {
			break
		}
		var s sampleErrorJSON
		s.ErrorMessage, s.Request.Identifier = r.Message, id
		et.SampleErrors = append(et.SampleErrors, s)
	}
	e.Data = eventDataJSON{
		DeveloperMessageSummary: fmt.Sprintf("%d meter events for %s failed: %s", r.ErrorCount, r.EventName, r.Code),
		Reason:                  eventReasonJSON{ErrorCount: int64(r.ErrorCount), ErrorTypes: []errorTypeJSON{et}},
		ValidationStart:         r.Created.UTC().Truncate(time.Minute), ValidationEnd: r.Created.UTC().Truncate(time.Minute).Add(time.Minute),
	}
	return e
}

// getEvent is GET /v2/core/events/{id}: one of the account's error reports
// as a full event.
func (s *Server) getEvent(w http.ResponseWriter, r *http.Request) {
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	var found *ErrorReport
	if a := s.accounts[c.account]; a != nil {
		for i := range a.reports {
			if a.reports[i].ID == id && a.reports[i].Livemode == c.livemode {
				rep := a.reports[i]
				found = &rep
			}
		}
	}
	s.mu.Unlock()
	if found == nil {
		writeError(w, errNoSuch(http.StatusNotFound, "event", "id", id))
		return
	}
	writeJSON(w, http.StatusOK, eventOf(*found))
}

// SignedThinEvent is the body and Stripe-Signature header of the thin
// event of report, signed with secret at t (stripe-go's test signer), as
// Stripe would post it.
func SignedThinEvent(report ErrorReport, secret string, t time.Time) (body []byte, signature string) {
	b, _ := json.Marshal(thinOf(report))
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: b, Secret: secret, Timestamp: t})
	return p.Payload, p.Header
}

// DeliverReports posts every error report of account not delivered yet to
// url as a signed thin event, like an event destination, and marks those
// answered 2xx delivered. It returns how many were delivered.
func (s *Server) DeliverReports(ctx context.Context, account, url, secret string) (int, error) {
	s.mu.Lock()
	a := s.accounts[account]
	var pending []ErrorReport
	if a != nil {
		for _, r := range a.reports {
			if !a.delivered[r.ID] {
				pending = append(pending, r)
			}
		}
	}
	s.mu.Unlock()
	n := 0
	for _, r := range pending {
		body, sig := SignedThinEvent(r, secret, time.Now())
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return n, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Stripe-Signature", sig)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return n, err
		}
		_ = resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			return n, fmt.Errorf("stripesim: delivering %s: status %d", r.ID, resp.StatusCode)
		}
		s.mu.Lock()
		a.delivered[r.ID] = true
		s.mu.Unlock()
		n++
	}
	return n, nil
}
