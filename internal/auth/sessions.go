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

// ErrNoSession says a presented session id is unknown, expired, ended, or
// of a token revoked since.
var ErrNoSession = errors.New("auth: no live session")

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

// OpenSession opens a session of the token for ttl (by the database's
// clock): a random id and a random CSRF token, each of 256 bits.
func OpenSession(ctx context.Context, q Querier, tokenID int64, ttl time.Duration) (NewSession, error) {
	id, err := randomSecret()
	if err != nil {
		return NewSession{}, fmt.Errorf("auth: generating a session id: %w", err)
	}
	csrf, err := randomSecret()
	if err != nil {
		return NewSession{}, fmt.Errorf("auth: generating a CSRF token: %w", err)
	}
	if _, err := q.Exec(ctx, `INSERT INTO console_sessions (id_hash, token_id, csrf, expires_at)
		VALUES ($1, $2, $3, clock_timestamp() + $4::interval)`, sessionHash(id), tokenID, csrf, ttl); err != nil {
		return NewSession{}, fmt.Errorf("auth: storing the session: %w", err)
	}
	return NewSession{ID: id, CSRF: csrf}, nil
}

// LookupSession returns the live session with the id: unexpired, and its
// token not revoked; ErrNoSession when there is none. The principal has
// the token's id, name and role, not its tenants (they scope ingest only).
func LookupSession(ctx context.Context, q Querier, id string) (Session, error) {
	var (
		s    Session
		role string
	)
	err := q.QueryRow(ctx, `SELECT t.id, t.name, t.role, s.csrf FROM console_sessions s JOIN api_tokens t ON t.id = s.token_id
		WHERE s.id_hash = $1 AND s.expires_at > clock_timestamp() AND t.revoked_at IS NULL`, sessionHash(id)).
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

// EndSession ends the session with the id: it expires now. Ending an
// unknown or ended session does nothing.
func EndSession(ctx context.Context, q Querier, id string) error {
	if _, err := q.Exec(ctx, `UPDATE console_sessions SET expires_at = clock_timestamp() WHERE id_hash = $1`, sessionHash(id)); err != nil {
		return fmt.Errorf("auth: ending the session: %w", err)
	}
	return nil
}
