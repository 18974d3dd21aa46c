package stripesim

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net/http"
	"time"
)

// idemKey scopes an Idempotency-Key like Stripe: per account and mode.
type idemKey struct {
	account  string
	livemode bool
	key      string
}

// idemEntry is a request seen with an Idempotency-Key: in flight until done,
// then its response, which later requests with the same key get replayed.
type idemEntry struct {
	// fingerprint is a sha256 of the first request's method, path and form
	// values or JSON body: a hash, so that keeping one per stream request
	// (stripe-go sends a fresh key with every POST) stays small.
	fingerprint [sha256.Size]byte
	done        bool
	status      int
	contentType string
	shouldRetry string // the kept answer's Stripe-Should-Retry header, if any
	body        []byte
	requestID   string
	created     time.Time // simulator clock; the key expires DedupWindow later
}

// recorder passes a response through and keeps a copy of its status and
// body, and whether an error written through it is one the idempotency
// layer must not keep.
type recorder struct {
	http.ResponseWriter
	status int
	body   bytes.Buffer
	unkept bool
}

func (w *recorder) noteError(e *apiError) {
	if !e.kept() {
		w.unkept = true
	}
}

func (w *recorder) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *recorder) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	w.body.Write(b)
	return w.ResponseWriter.Write(b)
}

// idempotent is Stripe's idempotency layer for POSTs (Stripe ignores the
// key on GET and DELETE). The first request with a key is executed and its
// response kept once the endpoint started executing — 2xx, 5xx (the
// faults of the execute layer included) and the 4xx the endpoint found
// while executing (no such customer, no active meter, a duplicate
// identifier) — and replayed, with Idempotent-Replayed: true and the first
// request's id in Original-Request, to every later request with the key and
// the same parameters. Nothing is kept for a validation error of the
// parameters (apiError.Validation), a 429 or a request held until the
// client gave up: a later request with the key is executed anew. The key
// reused with other parameters is refused (400 idempotency_error), and
// while its first request runs (409). Like Stripe, a key is forgotten
// DedupWindow (24 h on the simulator clock) after its first use.
func (s *Server) idempotent(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" || r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Idempotency-Key", key)
		c := callerOf(r)
		k := idemKey{account: c.account, livemode: c.livemode, key: key}
		// Form values compare as parameters (order-free); a body that is not
		// a form (v2 JSON) compares byte for byte.
		h := sha256.New()
		_, _ = io.WriteString(h, r.Method+" "+r.URL.Path+"?"+r.Form.Encode())
		if len(r.PostForm) == 0 {
			_, _ = h.Write([]byte("\n"))
			_, _ = h.Write(bodyOf(r))
		}
		var fp [sha256.Size]byte
		h.Sum(fp[:0])

		s.mu.Lock()
		now := s.now()
		e := s.idem[k]
		if e != nil && e.done && now.Sub(e.created) >= DedupWindow {
			e = nil
		}
		mine := e == nil
		if mine {
			e = &idemEntry{fingerprint: fp, requestID: recordOf(r).RequestID, created: now}
			s.idem[k] = e
		}
		snapshot := *e
		s.mu.Unlock()

		switch {
		case mine:
		case snapshot.fingerprint != fp:
			writeError(w, &apiError{Status: http.StatusBadRequest, Type: typeIdempotency,
				Message: "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '" + key + "' if you meant to execute a different request."})
			return
		case !snapshot.done:
			writeError(w, &apiError{Status: http.StatusConflict, Type: typeIdempotency, Code: "idempotency_key_in_use", notExecuted: true,
				Message: "There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): " + key + ". Please try again later."})
			return
		default:
			recordOf(r).Replayed = true
			w.Header().Set("Idempotent-Replayed", "true")
			w.Header().Set("Original-Request", snapshot.requestID)
			w.Header().Set("Content-Type", snapshot.contentType)
			if snapshot.shouldRetry != "" {
				w.Header().Set("Stripe-Should-Retry", snapshot.shouldRetry)
			}
			w.WriteHeader(snapshot.status)
			_, _ = w.Write(snapshot.body)
			return
		}

		rw := &recorder{ResponseWriter: w}
		defer func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if rw.status != 0 && !rw.unkept {
				e.done, e.status, e.body = true, rw.status, rw.body.Bytes()
				e.contentType = rw.Header().Get("Content-Type")
				e.shouldRetry = rw.Header().Get("Stripe-Should-Retry")
			} else if s.idem[k] == e {
				delete(s.idem, k)
			}
		}()
		next.ServeHTTP(rw, r)
	})
}
