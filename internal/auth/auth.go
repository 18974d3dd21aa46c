// Package auth owns API tokens: creating them (the secret is shown once and
// only its SHA-256 is stored), checking a presented token in constant time,
// listing them, and the roles, which nest: ingest < finance < operator <
// admin. An ingest token may be scoped to tenants. It also owns the web
// console's sign-in sessions (the console_sessions table), opened with a
// token: the browser holds a random id, only its SHA-256 is stored.
//
// It never stores, logs or returns a token after creation, never stores a
// session id, and never compares secrets with ==.
package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Role is what a token may do. Roles nest.
type Role string

// Roles, weakest first.
const (
	RoleIngest   Role = "ingest"
	RoleFinance  Role = "finance"
	RoleOperator Role = "operator"
	RoleAdmin    Role = "admin"
)

var rank = map[Role]int{RoleIngest: 1, RoleFinance: 2, RoleOperator: 3, RoleAdmin: 4}

// ParseRole validates a role name.
func ParseRole(s string) (Role, error) {
	r := Role(s)
	if rank[r] == 0 {
		return "", fmt.Errorf("unknown role %q: one of ingest, finance, operator, admin", s)
	}
	return r, nil
}

// Allows reports whether a holder of r may do what needs at least min.
func (r Role) Allows(min Role) bool { return rank[r] >= rank[min] && rank[r] > 0 }

// Principal is who a verified token belongs to.
type Principal struct {
	// TokenID and Name identify the token (the name is what audit trails show).
	TokenID int64
	Name    string
	Role    Role
	// Tenants scopes an ingest token; nil means every tenant.
	Tenants []string
}

// MayPostFor reports whether p may post usage for tenant.
func (p Principal) MayPostFor(tenant string) bool {
	return p.Role.Allows(RoleIngest) && (p.Tenants == nil || slices.Contains(p.Tenants, tenant))
}

// TokenPrefix starts every token Tally generates; it makes a leaked token
// recognisable to secret scanners and to the error sanitiser.
const TokenPrefix = "tly_tok_"

// ErrUnknownToken says the presented token is not a live token.
var ErrUnknownToken = errors.New("auth: unknown or revoked token")

// Querier runs SQL: a pool, a connection or a transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// NewToken is a token just created: Secret is shown once and never again.
type NewToken struct {
	Principal
	Secret string
}

var namePattern = regexp.MustCompile(`^[[:print:]]{1,100}$`)

// CreateToken makes a token with a fresh 256-bit secret. tenants scopes an
// ingest token (empty: every tenant); another role may not be scoped.
func CreateToken(ctx context.Context, q Querier, name string, role Role, tenants []string) (NewToken, error) {
	if rank[role] == 0 {
		return NewToken{}, fmt.Errorf("auth: unknown role %q", role)
	}
	if !namePattern.MatchString(name) {
		return NewToken{}, errors.New("auth: a token name is 1 to 100 printable characters")
	}
	if len(tenants) > 0 && role != RoleIngest {
		return NewToken{}, errors.New("auth: only an ingest token may be scoped to tenants")
	}
	var raw [32]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return NewToken{}, fmt.Errorf("auth: generating a token: %w", err)
	}
	secret := TokenPrefix + base64.RawURLEncoding.EncodeToString(raw[:])
	hash := sha256.Sum256([]byte(secret))
	var scope []string
	if len(tenants) > 0 {
		scope = slices.Clone(tenants)
	}
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO api_tokens (name, role, tenants, token_hash) VALUES ($1, $2, $3, $4) RETURNING id`,
		name, string(role), scope, hash[:]).Scan(&id)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.ConstraintName == "api_tokens_name_key" {
			return NewToken{}, fmt.Errorf("auth: a token named %q exists already", name)
		}
		return NewToken{}, fmt.Errorf("auth: storing the token: %w", err)
	}
	return NewToken{Principal: Principal{TokenID: id, Name: name, Role: role, Tenants: scope}, Secret: secret}, nil
}

// AdminTokenName names the admin token TALLY_ADMIN_TOKEN ensures.
const AdminTokenName = "admin (TALLY_ADMIN_TOKEN)"

// MinAdminTokenLength is the shortest TALLY_ADMIN_TOKEN accepted.
const MinAdminTokenLength = 24

// EnsureAdminToken makes secret a live admin token named AdminTokenName,
// replacing the hash of a previous TALLY_ADMIN_TOKEN (which stops working).
func EnsureAdminToken(ctx context.Context, q Querier, secret string) error {
	if len(secret) < MinAdminTokenLength {
		return fmt.Errorf("auth: TALLY_ADMIN_TOKEN must be at least %d characters", MinAdminTokenLength)
	}
	return EnsureToken(ctx, q, AdminTokenName, RoleAdmin, secret)
}

// EnsureToken makes secret a live, unscoped token of role named name,
// replacing that name's previous secret.
func EnsureToken(ctx context.Context, q Querier, name string, role Role, secret string) error {
	if rank[role] == 0 || !namePattern.MatchString(name) {
		return fmt.Errorf("auth: ensuring token %q: bad name or role", name)
	}
	hash := sha256.Sum256([]byte(secret))
	_, err := q.Exec(ctx, `
		INSERT INTO api_tokens (name, role, token_hash) VALUES ($1, $2, $3)
		ON CONFLICT (name) DO UPDATE SET token_hash = EXCLUDED.token_hash, role = EXCLUDED.role, tenants = NULL, revoked_at = NULL`,
		name, string(role), hash[:])
	if err != nil {
		return fmt.Errorf("auth: ensuring token %q: %w", name, err)
	}
	return nil
}

// Verify returns the principal of a presented token. The lookup is by the
// token's SHA-256, and the stored hash is then compared in constant time, so
// neither the database index nor Go's comparison reveals how much of a
// guess was right.
func Verify(ctx context.Context, q Querier, presented string) (Principal, error) {
	if presented == "" || len(presented) > 512 {
		return Principal{}, ErrUnknownToken
	}
	hash := sha256.Sum256([]byte(presented))
	var (
		p      Principal
		stored []byte
		role   string
	)
	err := q.QueryRow(ctx, `SELECT id, name, role, tenants, token_hash FROM api_tokens
		WHERE token_hash = $1 AND revoked_at IS NULL`, hash[:]).Scan(&p.TokenID, &p.Name, &role, &p.Tenants, &stored)
	if errors.Is(err, pgx.ErrNoRows) {
		return Principal{}, ErrUnknownToken
	}
	if err != nil {
		return Principal{}, fmt.Errorf("auth: reading tokens: %w", err)
	}
	if subtle.ConstantTimeCompare(stored, hash[:]) != 1 {
		return Principal{}, ErrUnknownToken
	}
	p.Role = Role(role)
	return p, nil
}

// Revoke ends a token by name.
func Revoke(ctx context.Context, q Querier, name string) error {
	tag, err := q.Exec(ctx, `UPDATE api_tokens SET revoked_at = clock_timestamp() WHERE name = $1 AND revoked_at IS NULL`, name)
	if err != nil {
		return fmt.Errorf("auth: revoking: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("auth: no live token named %q", name)
	}
	return nil
}

// Token is a token as listed: never its secret nor its hash.
type Token struct {
	Name string
	Role Role
	// Tenants scopes an ingest token; nil means every tenant.
	Tenants   []string
	CreatedAt time.Time
	// RevokedAt is nil while the token is live.
	RevokedAt *time.Time
}

// ListTokens lists every token, the revoked ones too, oldest first.
func ListTokens(ctx context.Context, q Querier) ([]Token, error) {
	rows, err := q.Query(ctx, `SELECT name, role, tenants, created_at, revoked_at FROM api_tokens ORDER BY created_at`)
	if err != nil {
		return nil, fmt.Errorf("auth: listing tokens: %w", err)
	}
	tokens, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Token, error) {
		var (
			t    Token
			role string
		)
		err := row.Scan(&t.Name, &role, &t.Tenants, &t.CreatedAt, &t.RevokedAt)
		t.Role = Role(role)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("auth: listing tokens: %w", err)
	}
	return tokens, nil
}
