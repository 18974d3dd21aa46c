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
	body        []byte
	requestID   string
	created     time.Time // simulator clock; the key expires DedupWindow later
}

// teeWriter keeps a copy of the body written through it.
type teeWriter struct {
	http.ResponseWriter
	status int
	body   bytes.Buffer
}

func (w *teeWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *teeWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	w.body.Write(b)
	return w.ResponseWriter.Write(b)
}

// idempotent replays the response of an earlier successful POST or DELETE
// with the same Idempotency-Key and parameters, rejects the key's reuse with
// other parameters (400 idempotency_error) and while the first request is
// still running (409). Only 2xx responses are kept: a failed request may be
// retried with its key. Like Stripe, a key is forgotten DedupWindow (24 h on
// the simulator clock) after its first use: a request with it is then new.
func (s *Server) idempotent(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" || (r.Method != http.MethodPost && r.Method != http.MethodDelete) {
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
			writeError(w, &apiError{Status: http.StatusConflict, Type: typeIdempotency, Code: "idempotency_key_in_use",
				Message: "There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): " + key + ". Please try again later."})
			return
		default:
			recordOf(r).Replayed = true
			w.Header().Set("Idempotent-Replayed", "true")
			w.Header().Set("Original-Request", snapshot.requestID)
			w.Header().Set("Content-Type", snapshot.contentType)
			w.WriteHeader(snapshot.status)
			_, _ = w.Write(snapshot.body)
			return
		}

		tw := &teeWriter{ResponseWriter: w}
		defer func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if tw.status >= 200 && tw.status < 300 {
				e.done, e.status, e.body = true, tw.status, tw.body.Bytes()
				e.contentType = tw.Header().Get("Content-Type")
			} else if s.idem[k] == e {
				delete(s.idem, k)
			}
		}()
		next.ServeHTTP(tw, r)
	})
}
