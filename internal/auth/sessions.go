package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
)

// Session is a signed-in console browser: the token it signed in with and
// the CSRF token its forms carry.
type Session struct {
	Principal
	CSRF string
}

// NewSession is a session just opened. ID goes in the browser's cookie and
// nowhere else: only its SHA-256 is stored.
type NewSession struct {
	ID   string
	CSRF string
}

// ErrNoSession says a presented session id is unknown, expired, ended,
// idle for too long, or of a token revoked since.
var ErrNoSession = errors.New("auth: no live session")

// The audit log's actions of console sessions: a sign-in (the subject is
// the token), a refused sign-in (the subject is the address; nothing of the
// presented token is recorded) and a sign-out.
const (
	ActionSignIn        = "session.open"
	ActionSignInRefused = "session.refused"
	ActionSignOut       = "session.close"
)

// SessionTouchInterval is the most often a session's last_seen_at is
// written: a session in use costs a write a minute at most, not one a
// page. With an idle timeout under ten minutes it is a tenth of that
// timeout instead.
const SessionTouchInterval = time.Minute

// randomSecret is 256 random bits, URL-safe.
func randomSecret() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

func sessionHash(id string) []byte {
	h := sha256.Sum256([]byte(id))
	return h[:]
}

// tokenSubject is the audit subject of a token, by its name.
func tokenSubject(name string) string { return "token:" + name }

// sessionActor is who acts with a console session, as the console's own
// actions are audited.
func sessionActor(name string) string { return "console:" + name }

// OpenSession opens a session of p's token for ttl (by the database's
// clock) — a random id and a random CSRF token, each of 256 bits — and
// records the sign-in from address in the audit log. q should be the
// caller's transaction, so that the session and its entry commit together.
func OpenSession(ctx context.Context, q pgdb.Querier, p Principal, ttl time.Duration, address string) (NewSession, error) {
	id, err := randomSecret()
	if err != nil {
		return NewSession{}, fmt.Errorf("auth: generating a session id: %w", err)
	}
	csrf, err := randomSecret()
	if err != nil {
		return NewSession{}, fmt.Errorf("auth: generating a CSRF token: %w", err)
	}
	if _, err := q.Exec(ctx, `INSERT INTO console_sessions (id_hash, token_id, csrf, expires_at)
		VALUES ($1, $2, $3, clock_timestamp() + $4::interval)`, sessionHash(id), p.TokenID, csrf, ttl); err != nil {
		return NewSession{}, fmt.Errorf("auth: storing the session: %w", err)
	}
	if err := audit.Record(ctx, q, audit.Entry{Actor: sessionActor(p.Name), Action: ActionSignIn, Subject: tokenSubject(p.Name),
		Details: map[string]any{"address": address}}); err != nil {
		return NewSession{}, err
	}
	return NewSession{ID: id, CSRF: csrf}, nil
}

// RecordRefusedSignIn records in the audit log that a sign-in from address
// was refused (an unknown or revoked token, or one that may not sign in).
// Nothing of the presented token is recorded.
func RecordRefusedSignIn(ctx context.Context, q pgdb.Querier, address string) error {
	return audit.Record(ctx, q, audit.Entry{Actor: "console:anonymous", Action: ActionSignInRefused, Subject: "address:" + address,
		Reason: "sign-in refused", Details: map[string]any{"address": address}})
}

// touchEvery is how stale last_seen_at may grow before a lookup writes it:
// SessionTouchInterval, or a tenth of a shorter idle timeout, so that a
// session in use never looks idle.
func touchEvery(idle time.Duration) time.Duration {
	if idle > 0 && idle/10 < SessionTouchInterval {
		return idle / 10
	}
	return SessionTouchInterval
}

// LookupSession returns the live session with the id: unexpired, used
// within idle (idle ≤ 0: no idle timeout), and its token not revoked;
// ErrNoSession when there is none. Finding it counts as a use: its
// last_seen_at moves to now, written at most once per
// SessionTouchInterval. The principal has the token's id, name and role,
// not its tenants (they scope ingest only).
func LookupSession(ctx context.Context, q pgdb.Querier, id string, idle time.Duration) (Session, error) {
	var (
		s    Session
		role string
	)
	err := q.QueryRow(ctx, `WITH live AS (
			SELECT s.id_hash, s.last_seen_at, t.id, t.name, t.role, s.csrf
			FROM console_sessions s JOIN api_tokens t ON t.id = s.token_id
			WHERE s.id_hash = $1 AND s.expires_at > clock_timestamp() AND t.revoked_at IS NULL
				AND (t.expires_at IS NULL OR t.expires_at > clock_timestamp())
				AND ($2::interval <= interval '0' OR s.last_seen_at > clock_timestamp() - $2::interval)
		), seen AS (
			UPDATE console_sessions s SET last_seen_at = clock_timestamp() FROM live
			WHERE s.id_hash = live.id_hash AND live.last_seen_at <= clock_timestamp() - $3::interval
		)
		SELECT id, name, role, csrf FROM live`, sessionHash(id), idle, touchEvery(idle)).
		Scan(&s.TokenID, &s.Name, &role, &s.CSRF)
	if errors.Is(err, pgx.ErrNoRows) {
		return Session{}, ErrNoSession
	}
	if err != nil {
		return Session{}, fmt.Errorf("auth: reading the session: %w", err)
	}
	s.Role = Role(role)
	return s, nil
}

// EndSession ends the live session with the id — it expires now — and
// records the sign-out from address in the audit log; q should be the
// caller's transaction. Ending an unknown or ended session does nothing
// and records nothing.
func EndSession(ctx context.Context, q pgdb.Querier, id, address string) error {
	var name string
	err := q.QueryRow(ctx, `UPDATE console_sessions s SET expires_at = clock_timestamp() FROM api_tokens t
		WHERE s.id_hash = $1 AND s.expires_at > clock_timestamp() AND t.id = s.token_id RETURNING t.name`, sessionHash(id)).Scan(&name)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("auth: ending the session: %w", err)
	}
	return audit.Record(ctx, q, audit.Entry{Actor: sessionActor(name), Action: ActionSignOut, Subject: tokenSubject(name),
		Details: map[string]any{"address": address}})
}

// PurgeSessions deletes up to limit sessions that have ended — expired,
// signed out, unused for idle (idle ≤ 0: none ends so), or of a revoked
// token — and returns how many it deleted. Rows another transaction holds
// are skipped, so concurrent purges neither wait for nor deadlock with
// each other. Live sessions are never touched.
func PurgeSessions(ctx context.Context, q pgdb.Querier, idle time.Duration, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM console_sessions WHERE id_hash IN (
			SELECT s.id_hash FROM console_sessions s JOIN api_tokens t ON t.id = s.token_id
			WHERE s.expires_at <= clock_timestamp() OR t.revoked_at IS NOT NULL OR t.expires_at <= clock_timestamp()
				OR ($1::interval > interval '0' AND s.last_seen_at <= clock_timestamp() - $1::interval)
			LIMIT $2 FOR UPDATE OF s SKIP LOCKED)`, idle, limit)
	if err != nil {
		return 0, fmt.Errorf("auth: purging ended sessions: %w", err)
	}
	return tag.RowsAffected(), nil
}
