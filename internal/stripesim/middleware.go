package stripesim

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

type ctxKey int

const (
	stateKey ctxKey = iota
	callerKey
	planKey
)

// maxBody bounds a request body, like net/http's form parsing does.
const maxBody = 10 << 20

// reqState is what begin keeps for the rest of the chain.
type reqState struct {
	rec  *Recorded
	body []byte // the raw body, also for non-form (JSON) bodies
}

// caller is who a request acts as, set by authenticate.
type caller struct {
	account  string // the account the request acts on
	livemode bool   // the key's mode
	connect  bool   // acting on a connected account (Stripe-Account or Stripe-Context)
	own      string // the key's own account
	context  string // the account Stripe-Context names, empty without it
}

// callerOf returns the authenticated caller of r. Only handlers behind
// authenticate may call it.
func callerOf(r *http.Request) caller {
	return r.Context().Value(callerKey).(caller)
}

// recordOf returns the request's pending record, filled in by middleware
// and appended to the request log when the response is done.
func recordOf(r *http.Request) *Recorded {
	if st, _ := r.Context().Value(stateKey).(*reqState); st != nil {
		return st.rec
	}
	return &Recorded{}
}

// bodyOf returns the raw request body read by begin.
func bodyOf(r *http.Request) []byte {
	if st, _ := r.Context().Value(stateKey).(*reqState); st != nil {
		return st.body
	}
	return nil
}

// statusWriter remembers the status written through it.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

// begin gives every response a Request-Id, parses the form values, turns a
// panic into Stripe's api_error and records the request once answered.
func (s *Server) begin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &Recorded{
			Time:           s.now(),
			RequestID:      newRequestID(),
			Method:         r.Method,
			Path:           r.URL.Path,
			StripeAccount:  r.Header.Get("Stripe-Account"),
			StripeContext:  r.Header.Get("Stripe-Context"),
			IdempotencyKey: r.Header.Get("Idempotency-Key"),
		}
		w.Header().Set("Request-Id", rec.RequestID)
		if v := r.Header.Get("Stripe-Version"); v != "" {
			w.Header().Set("Stripe-Version", v)
		}
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			if p := recover(); p != nil {
				if p == http.ErrAbortHandler {
					panic(p)
				}
				if sw.status == 0 {
					writeError(sw, &apiError{Status: http.StatusInternalServerError, Type: typeAPI,
						Message: fmt.Sprintf("stripesim: internal error: %v", p)})
				}
			}
			rec.Status = sw.status
			if rec.Status == 0 {
				rec.Status = http.StatusOK
			}
			s.mu.Lock()
			s.requests = append(s.requests, *rec)
			s.mu.Unlock()
		}()
		body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
		if err != nil || len(body) > maxBody {
			writeError(sw, errValidation("", "", "Invalid request: the body could not be read or is larger than %d bytes.", maxBody))
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		err = r.ParseForm()
		if err == nil && r.Method == http.MethodDelete && len(body) > 0 {
			// net/http parses the body of POST, PUT and PATCH only;
			// stripe-go sends a DELETE's parameters (invoice_now) in it.
			var vs url.Values
			if vs, err = url.ParseQuery(string(body)); err == nil {
				for k, v := range vs {
					r.Form[k] = append(r.Form[k], v...)
				}
			}
		}
		rec.Form = cloneValues(r.Form)
		if err != nil {
			writeError(sw, errValidation("", "", "Invalid request: the body could not be parsed as form values."))
			return
		}
		// What Stripe would have done by now happens before the request
		// is served: renewals, automatic finalizations.
		s.mu.Lock()
		s.advanceBillingLocked(s.now())
		s.mu.Unlock()
		st := &reqState{rec: rec, body: body}
		next.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), stateKey, st)))
	})
}

// apiKey returns the key of a Bearer or Basic Authorization header.
func apiKey(r *http.Request) string {
	scheme, rest, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	switch strings.ToLower(scheme) {
	case "bearer":
		return strings.TrimSpace(rest)
	case "basic":
		dec, err := base64.StdEncoding.DecodeString(strings.TrimSpace(rest))
		if err != nil {
			return ""
		}
		user, _, _ := strings.Cut(string(dec), ":")
		return user
	}
	return ""
}

// authenticate resolves the key and the account the request acts on. The
// v2 meter event stream authenticates with a session token instead.
func (s *Server) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == streamPath {
			s.authenticateSession(next, w, r)
			return
		}
		key := apiKey(r)
		if key == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="Stripe"`)
			writeError(w, errInvalid(http.StatusUnauthorized, "", "",
				"You did not provide an API key. You need to provide your API key in the Authorization header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY'). See https://stripe.com/docs/api#authentication for details, or we can help at https://support.stripe.com/."))
			return
		}
		// Stripe-Context supersedes Stripe-Account (docs.stripe.com/context):
		// with both, the context names the account. Its value is a path of
		// accounts ("acct_…", or "acct_…/acct_…" below an organization);
		// the last one is the account acted on.
		header := r.Header.Get("Stripe-Account")
		scope := r.Header.Get("Stripe-Context")
		connect := header
		if scope != "" {
			connect = scope[strings.LastIndexByte(scope, '/')+1:]
			header = scope
		}
		s.mu.Lock()
		own, known := s.keys[key]
		target := own
		ca, connectKnown := s.accounts[connect]
		connectKnown = connectKnown && !ca.revoked
		s.mu.Unlock()
		if !known {
			w.Header().Set("WWW-Authenticate", `Bearer realm="Stripe"`)
			writeError(w, errInvalid(http.StatusUnauthorized, "", "", "Invalid API Key provided: %s", maskKey(key)))
			return
		}
		if connect != "" {
			if !connectKnown {
				writeError(w, s.accountInvalid(key, header))
				return
			}
			target = connect
		}
		c := caller{account: target, livemode: isLiveKey(key), connect: connect != "", own: own}
		if scope != "" {
			c.context = connect
		}
		rec := recordOf(r)
		rec.Account, rec.Livemode = c.account, c.livemode
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey, c)))
	})
}
