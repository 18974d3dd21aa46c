package console

import (
	"context"
	"crypto/subtle"
	"errors"
	"net/http"
	"time"

	"github.com/tallymeter/tally/internal/auth"
)

const (
	cookieName = "tally_session"
	sessionTTL = 8 * time.Hour
)

type sessionKey struct{}

// sessionOf is the request's session: the token it signed in with and
// the CSRF token its forms carry.
func sessionOf(r *http.Request) (auth.Session, bool) {
	s, ok := r.Context().Value(sessionKey{}).(auth.Session)
	return s, ok
}

// signIn verifies an API token and opens a session for it (auth keeps it):
// a random id in an HttpOnly, SameSite=Strict cookie, only its hash in the
// database.
func (c *Console) signIn(w http.ResponseWriter, r *http.Request, token string) (auth.Principal, error) {
	p, err := auth.Verify(r.Context(), c.pool, token)
	if err != nil {
		return auth.Principal{}, err
	}
	if !p.Role.Allows(auth.RoleFinance) {
		return auth.Principal{}, errIngestOnly
	}
	s, err := auth.OpenSession(r.Context(), c.pool, p.TokenID, sessionTTL)
	if err != nil {
		return auth.Principal{}, err
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: s.ID, Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: int(sessionTTL / time.Second)})
	return p, nil
}

var errIngestOnly = errors.New("an ingest token cannot sign in to the console")

// lookup finds the request's session: unexpired, and its token not revoked.
func (c *Console) lookup(ctx context.Context, r *http.Request) (auth.Session, bool) {
	ck, err := r.Cookie(cookieName)
	if err != nil || ck.Value == "" {
		return auth.Session{}, false
	}
	s, err := auth.LookupSession(ctx, c.pool, ck.Value)
	if err != nil {
		return auth.Session{}, false
	}
	return s, true
}

// signOut ends the session: the row expires and the cookie is cleared.
func (c *Console) signOut(w http.ResponseWriter, r *http.Request) {
	if ck, err := r.Cookie(cookieName); err == nil {
		_ = auth.EndSession(r.Context(), c.pool, ck.Value)
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, MaxAge: -1})
}

// checkCSRF: a state-changing request carries its session's CSRF token in
// the form, and, when the browser says where it comes from, comes from
// this host.
func checkCSRF(r *http.Request, s auth.Session) bool {
	if origin := r.Header.Get("Origin"); origin != "" && origin != "null" {
		if u := "http://" + r.Host; origin != u && origin != "https://"+r.Host {
			return false
		}
	}
	got := r.PostFormValue("csrf")
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.CSRF)) == 1
}
