package console

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/auth"
)

const (
	cookieName = "tally_session"
	sessionTTL = 8 * time.Hour
)

// session is a signed-in browser: the token it signed in with and the
// CSRF token its forms carry.
type session struct {
	auth.Principal
	CSRF string
}

type sessionKey struct{}

func sessionOf(r *http.Request) (session, bool) {
	s, ok := r.Context().Value(sessionKey{}).(session)
	return s, ok
}

func randomToken() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

func hashOf(id string) []byte {
	h := sha256.Sum256([]byte(id))
	return h[:]
}

// signIn verifies an API token and opens a session for it: a random id in
// an HttpOnly, SameSite=Strict cookie, only its hash in the database.
func (c *Console) signIn(w http.ResponseWriter, r *http.Request, token string) (auth.Principal, error) {
	p, err := auth.Verify(r.Context(), c.pool, token)
	if err != nil {
		return auth.Principal{}, err
	}
	if !p.Role.Allows(auth.RoleFinance) {
		return auth.Principal{}, errIngestOnly
	}
	id, err := randomToken()
	if err != nil {
		return auth.Principal{}, err
	}
	csrf, err := randomToken()
	if err != nil {
		return auth.Principal{}, err
	}
	if _, err := c.pool.Exec(r.Context(), `INSERT INTO console_sessions (id_hash, token_id, csrf, expires_at)
		VALUES ($1, $2, $3, clock_timestamp() + $4::interval)`, hashOf(id), p.TokenID, csrf, sessionTTL); err != nil {
		return auth.Principal{}, err
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: id, Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: int(sessionTTL / time.Second)})
	return p, nil
}

var errIngestOnly = errors.New("an ingest token cannot sign in to the console")

// lookup finds the request's session: unexpired, and its token not revoked.
func (c *Console) lookup(ctx context.Context, r *http.Request) (session, bool) {
	ck, err := r.Cookie(cookieName)
	if err != nil || ck.Value == "" {
		return session{}, false
	}
	var s session
	err = c.pool.QueryRow(ctx, `SELECT t.id, t.name, t.role, s.csrf FROM console_sessions s JOIN api_tokens t ON t.id = s.token_id
		WHERE s.id_hash = $1 AND s.expires_at > clock_timestamp() AND t.revoked_at IS NULL`, hashOf(ck.Value)).
		Scan(&s.TokenID, &s.Name, &s.Role, &s.CSRF)
	if errors.Is(err, pgx.ErrNoRows) || err != nil {
		return session{}, false
	}
	return s, true
}

// signOut ends the session: the row expires and the cookie is cleared.
func (c *Console) signOut(w http.ResponseWriter, r *http.Request) {
	if ck, err := r.Cookie(cookieName); err == nil {
		_, _ = c.pool.Exec(r.Context(), `UPDATE console_sessions SET expires_at = clock_timestamp() WHERE id_hash = $1`, hashOf(ck.Value))
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, MaxAge: -1})
}

// checkCSRF: a state-changing request carries its session's CSRF token in
// the form, and, when the browser says where it comes from, comes from
// this host.
func checkCSRF(r *http.Request, s session) bool {
	if origin := r.Header.Get("Origin"); origin != "" && origin != "null" {
		if u := "http://" + r.Host; origin != u && origin != "https://"+r.Host {
			return false
		}
	}
	got := r.PostFormValue("csrf")
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.CSRF)) == 1
}
