package console

import (
	"context"
	"crypto/subtle"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/httpsec"
)

const cookieName = "tally_session"

// The session defaults (TALLY_CONSOLE_SESSION_TTL and
// TALLY_CONSOLE_SESSION_IDLE), and how many ended sessions a sign-in
// deletes at most.
const (
	// DefaultSessionTTL is how long a session lasts at most, however much
	// it is used.
	DefaultSessionTTL = 8 * time.Hour
	// DefaultSessionIdle is how long a session lasts unused.
	DefaultSessionIdle = 30 * time.Minute
	// sessionPurgeBatch is how many ended sessions each sign-in deletes
	// at most: the table keeps little more than the live sessions.
	sessionPurgeBatch = 100
)

type sessionKey struct{}

// sessionOf is the request's session: the token it signed in with and
// the CSRF token its forms carry.
func sessionOf(r *http.Request) (auth.Session, bool) {
	s, ok := r.Context().Value(sessionKey{}).(auth.Session)
	return s, ok
}

// signIn verifies an API token and opens a session for it (auth keeps it
// and audits it), in one transaction that also deletes up to
// sessionPurgeBatch ended sessions: a random id in an HttpOnly,
// SameSite=Strict cookie, only its hash in the database. A refused token
// is audited too, with the address and nothing of the token. The token is
// verified on the pool, before the transaction: auth.Verify notes the
// token's use in a statement of its own.
func (c *Console) signIn(w http.ResponseWriter, r *http.Request, token, addr string) (auth.Principal, error) {
	ctx := r.Context()
	var s auth.NewSession
	p, err := auth.Verify(ctx, c.pool, token)
	if err == nil && !p.Role.Allows(auth.RoleFinance) {
		err = errIngestOnly
	}
	if err == nil {
		err = pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
			if _, err := auth.PurgeSessions(ctx, tx, c.SessionIdle, sessionPurgeBatch); err != nil {
				return err
			}
			var err error
			s, err = auth.OpenSession(ctx, tx, p, c.SessionTTL, addr)
			return err
		})
	}
	if errors.Is(err, auth.ErrUnknownToken) || errors.Is(err, errIngestOnly) {
		// The refusal stands (and counts against the address) even when
		// the database cannot record it; the log says so.
		if record, unaudited := c.throttle.auditRefusal(); !record {
			if unaudited > 0 {
				c.Logger.WarnContext(ctx, "console: refused sign-ins past the audit log's bound, counted here instead", "refused", unaudited)
			}
		} else if aerr := auth.RecordRefusedSignIn(ctx, c.pool, addr); aerr != nil {
			c.Logger.ErrorContext(ctx, "console: recording a refused sign-in failed", "error", aerr)
		}
	}
	if err != nil {
		return auth.Principal{}, err
	}
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: s.ID, Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: httpsec.ClientHTTPS(r), MaxAge: int(c.SessionTTL / time.Second)})
	return p, nil
}

var errIngestOnly = errors.New("an ingest token cannot sign in to the console")

// lookup finds the request's session: unexpired, used within the idle
// timeout, and its token not revoked. had says whether the request
// carried a session cookie at all.
func (c *Console) lookup(ctx context.Context, r *http.Request) (s auth.Session, ok, had bool) {
	ck, err := r.Cookie(cookieName)
	if err != nil || ck.Value == "" {
		return auth.Session{}, false, false
	}
	s, err = auth.LookupSession(ctx, c.pool, ck.Value, c.SessionIdle)
	if err != nil {
		return auth.Session{}, false, true
	}
	return s, true, true
}

// signOut ends the session (the row expires; auth audits it) and clears
// the cookie.
func (c *Console) signOut(w http.ResponseWriter, r *http.Request) error {
	if ck, err := r.Cookie(cookieName); err == nil {
		err := pgx.BeginFunc(r.Context(), c.pool, func(tx pgx.Tx) error {
			return auth.EndSession(r.Context(), tx, ck.Value, clientAddr(r))
		})
		if err != nil {
			return err
		}
	}
	clearCookie(w)
	return nil
}

func clearCookie(w http.ResponseWriter) {
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/console/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, MaxAge: -1})
}

// fromThisSite reports whether a browser's POST comes from a page of this
// host: its Origin header — or, for the sign-in form when there is none,
// its Referer — names http(s)://Host. The sign-in form is strict (it has
// no session token to carry yet): a request that names neither, or an
// opaque origin ("null": a sandboxed frame, a no-referrer page), is
// refused. The session's forms are not: they carry their CSRF token, so
// only an Origin naming another site refuses them.
func fromThisSite(r *http.Request, strict bool) bool {
	source := r.Header.Get("Origin")
	switch {
	case source == "null", source == "" && !strict:
		return !strict
	case source == "":
		ref, err := url.Parse(r.Header.Get("Referer"))
		if err != nil || ref.Host == "" {
			return false
		}
		source = ref.Scheme + "://" + ref.Host
	}
	return strings.EqualFold(source, "http://"+r.Host) || strings.EqualFold(source, "https://"+r.Host)
}

// checkCSRF: a state-changing request carries its session's CSRF token in
// the form, and, when the browser says where it comes from, comes from
// this host.
func checkCSRF(r *http.Request, s auth.Session) bool {
	if !fromThisSite(r, false) {
		return false
	}
	got := r.PostFormValue("csrf")
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.CSRF)) == 1
}
