package api

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"github.com/tallymeter/tally/internal/auth"
)

type principalKey struct{}

// principal is the verified caller of a /v1 request.
func principal(r *http.Request) auth.Principal {
	p, _ := r.Context().Value(principalKey{}).(auth.Principal)
	return p
}

// authenticate verifies the bearer token of every /v1 request: 401 without a
// valid one. A token verified within auth.VerifiedTTL is not looked up
// again, so a revocation takes effect within that. The token itself never
// reaches a log.
func (h *handlers) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		header := r.Header.Get("Authorization")
		scheme, token, ok := strings.Cut(header, " ")
		if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="tally"`)
			WriteError(w, http.StatusUnauthorized, "unauthorized", "send Authorization: Bearer <token>")
			return
		}
		p, err := h.quotas.verified.Verify(r.Context(), h.Pool, strings.TrimSpace(token))
		if errors.Is(err, auth.ErrUnknownToken) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="tally", error="invalid_token"`)
			WriteError(w, http.StatusUnauthorized, "unauthorized", "unknown, revoked or expired token")
			return
		}
		if err != nil {
			h.internal(w, r, err)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, p)))
	})
}

// require answers 403 unless the caller's role is at least min.
func require(min auth.Role) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !principal(r).Role.Allows(min) {
				WriteError(w, http.StatusForbidden, "forbidden", "this needs the "+string(min)+" role or above")
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}
