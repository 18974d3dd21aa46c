package api

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

func (h *handlers) getSummary(w http.ResponseWriter, r *http.Request) {
	g, err := h.Outbox.ReadGauge(r.Context(), h.Pool)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	counts := make(map[string]int64, len(g.Counts))
	for st, n := range g.Counts {
		counts[string(st)] = n
	}
	writeJSON(w, http.StatusOK, map[string]any{"counts": counts, "oldest_pending_age_seconds": g.OldestPendingAgeSeconds})
}

// ItemView is an item as the API shows it.
type ItemView struct {
	ID                 int64             `json:"id"`
	Tenant             string            `json:"tenant"`
	SubjectKind        string            `json:"subject_kind"`
	SubjectRef         string            `json:"subject_ref"`
	Exporter           string            `json:"exporter"`
	DestinationAccount string            `json:"destination_account"`
	Mode               outbox.Mode       `json:"mode"`
	MappingVersion     int               `json:"mapping_version"`
	Identifier         string            `json:"identifier"`
	Payload            outbox.Payload    `json:"payload"`
	State              outbox.State      `json:"state"`
	Attempts           int               `json:"attempts"`
	LeaseToken         int64             `json:"lease_token"`
	NextAttemptAt      time.Time         `json:"next_attempt_at"`
	FirstAttemptAt     *time.Time        `json:"first_attempt_at,omitempty"`
	ProviderRef        string            `json:"provider_ref,omitempty"`
	AcceptedAt         *time.Time        `json:"accepted_at,omitempty"`
	ConfirmedAt        *time.Time        `json:"confirmed_at,omitempty"`
	LastError          *outbox.ErrorInfo `json:"last_error,omitempty"`
	QuarantineReason   outbox.Reason     `json:"quarantine_reason,omitempty"`
	SupersededBy       *int64            `json:"superseded_by,omitempty"`
	CreatedAt          time.Time         `json:"created_at"`
	UpdatedAt          time.Time         `json:"updated_at"`
	AttemptLog         []outbox.Attempt  `json:"attempt_log,omitempty"`
	Audit              []audit.Entry     `json:"audit,omitempty"`
	// Evidence is what Stripe's meter error reports say of the item.
	Evidence []reconcile.Evidence `json:"evidence,omitempty"`
}

// ViewOf is it as GET /v1/outbox/items shows it (and tally items list):
// its last error only while it is still the item's (Item.CurrentError).
func ViewOf(it outbox.Item) ItemView {
	return ItemView{
		ID: it.ID, Tenant: it.TenantKey, SubjectKind: it.SubjectKind, SubjectRef: it.SubjectRef, Exporter: it.Exporter,
		DestinationAccount: it.DestinationAccount, Mode: it.Mode, MappingVersion: it.MappingVersion,
		Identifier: it.Identifier, Payload: it.Payload, State: it.State, Attempts: it.Attempts, LeaseToken: it.LeaseToken,
		NextAttemptAt: it.NextAttemptAt, FirstAttemptAt: it.FirstAttemptAt, ProviderRef: it.ProviderRef,
		AcceptedAt: it.AcceptedAt, ConfirmedAt: it.ConfirmedAt, LastError: it.CurrentError(),
		QuarantineReason: it.QuarantineReason, SupersededBy: it.SupersededBy, CreatedAt: it.CreatedAt, UpdatedAt: it.UpdatedAt,
	}
}

func (h *handlers) listItems(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r, "state", "tenant", "feature", "limit", "after") {
		return
	}
	q := r.URL.Query()
	f := outbox.ListFilter{State: outbox.State(q.Get("state")), Tenant: q.Get("tenant"), Feature: q.Get("feature")}
	if f.State != "" && !validState(f.State) {
		WriteError(w, http.StatusBadRequest, "invalid_state", "state must be one of the outbox states")
		return
	}
	var err error
	if s := q.Get("limit"); s != "" {
		if f.Limit, err = strconv.Atoi(s); err != nil || f.Limit < 1 || f.Limit > 1000 {
			WriteError(w, http.StatusBadRequest, "invalid_limit", "limit must be 1 to 1000")
			return
		}
	}
	if s := q.Get("after"); s != "" {
		if f.After, err = strconv.ParseInt(s, 10, 64); err != nil || f.After < 0 {
			WriteError(w, http.StatusBadRequest, "invalid_after", "after must be an item id")
			return
		}
	}
	items, err := h.Outbox.List(r.Context(), h.Pool, f)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	views := make([]ItemView, len(items))
	for i, it := range items {
		views[i] = ViewOf(it)
	}
	out := map[string]any{"items": views}
	if limit := max(f.Limit, 100); len(items) == limit || (f.Limit > 0 && len(items) == f.Limit) {
		out["next_after"] = items[len(items)-1].ID // a full page: there may be more
	}
	writeJSON(w, http.StatusOK, out)
}

// onlyParams refuses (400 unknown_parameter) a request whose query names a
// parameter other than known: a misspelt filter must not read as no
// filter at all.
func onlyParams(w http.ResponseWriter, r *http.Request, known ...string) bool {
	for name := range r.URL.Query() {
		if !slices.Contains(known, name) {
			msg := fmt.Sprintf("unknown parameter %q", redact.Message(truncate(name, maxParamEcho)))
			if len(known) == 0 {
				msg += ": this route takes no query parameters"
			} else {
				msg += ": this route takes " + strings.Join(known, ", ")
			}
			WriteError(w, http.StatusBadRequest, "unknown_parameter", msg)
			return false
		}
	}
	return true
}

// maxParamEcho is the most characters of an unknown parameter's name an
// error repeats.
const maxParamEcho = 40

func truncate(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n]) + "…"
	}
	return s
}

func validState(s outbox.State) bool {
	for _, st := range outbox.States {
		if s == st {
			return true
		}
	}
	return false
}

func itemID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id < 1 {
		WriteError(w, http.StatusNotFound, "not_found", "no such item")
		return 0, false
	}
	return id, true
}

func (h *handlers) getItem(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(w, r)
	if !ok {
		return
	}
	it, err := h.Outbox.Get(r.Context(), h.Pool, id)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	attempts, err := h.Outbox.Attempts(r.Context(), h.Pool, id)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	trail, err := audit.List(r.Context(), h.Pool, audit.Item(id), 100)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	evidence, err := reconcile.EvidenceOf(r.Context(), h.Pool, []int64{id})
	if err != nil {
		h.internal(w, r, err)
		return
	}
	v := ViewOf(it)
	v.AttemptLog = attempts
	v.Audit = trail
	v.Evidence = evidence
	writeJSON(w, http.StatusOK, v)
}
