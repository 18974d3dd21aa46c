// Package auth owns API tokens: creating them (the secret is shown once and
// only its SHA-256 is stored), checking a presented token in constant time
// (refusing a revoked or expired one), noting when each was last used,
// listing and revoking them, seeding the tokens whose value comes from
// configuration (seed.go), the strength a configured secret must have,
// and the roles, which nest: ingest < finance < operator < admin. An
// ingest token may be scoped to tenants. Posting a correction (a negative
// usage value) is a permission of its own: an ingest or finance token has
// it only when made with it; operator and admin tokens always have it. Creating and revoking a token is
// recorded in the audit log in the same transaction. It also owns the web
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

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
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
	// Corrections says the token may post corrections (negative values).
	Corrections bool
}

// MayPostFor reports whether p may post usage for tenant.
func (p Principal) MayPostFor(tenant string) bool {
	return p.Role.Allows(RoleIngest) && (p.Tenants == nil || slices.Contains(p.Tenants, tenant))
}

// MayCorrect reports whether p may post corrections: negative usage
// values, which lower a bill. An operator or admin always may; an ingest or
// finance token when it was made with the permission.
func (p Principal) MayCorrect() bool {
	return p.Role.Allows(RoleIngest) && (p.Corrections || p.Role.Allows(RoleOperator))
}

// TokenPrefix starts every token Tally generates; it makes a leaked token
// recognisable to secret scanners and to the error sanitiser.
const TokenPrefix = "tly_tok_"

// ErrUnknownToken says the presented token is not a live token: unknown,
// revoked, or past its expiry.
var ErrUnknownToken = errors.New("auth: unknown, revoked or expired token")

// NewToken is a token just created: Secret is shown once and never again.
type NewToken struct {
	Principal
	Secret string
	// ExpiresAt is when it stops working; nil: never.
	ExpiresAt *time.Time
}

var namePattern = regexp.MustCompile(`^[[:print:]]{1,100}$`)

// TokenSpec is a token to create.
type TokenSpec struct {
	Name string
	Role Role
	// Tenants scopes an ingest token; empty: every tenant. Another role
	// may not be scoped.
	Tenants []string
	// Corrections lets an ingest or finance token post corrections
	// (negative values). Defaults to false: it may not. An operator or
	// admin token always may, whatever this says.
	Corrections bool
	// ExpiresIn, when positive, ends the token that long after it is made,
	// by the database's clock. Zero: it never expires.
	ExpiresIn time.Duration
	// By is who makes it, as the audit log shows it (cli:<user>).
	By string
}

// Create makes a token with a fresh 256-bit secret and records it in the
// audit log, in one transaction.
func Create(ctx context.Context, db pgdb.Beginner, spec TokenSpec) (NewToken, error) {
	if spec.ExpiresIn < 0 {
		return NewToken{}, errors.New("auth: a token's lifetime must be positive")
	}
	var tok NewToken
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		if tok, err = insertToken(ctx, tx, spec, ""); err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: spec.By, Action: audit.ActionTokenCreate, Subject: audit.Token(spec.Name),
			To: "live", Details: tokenDetails(tok)})
	})
	if err != nil {
		return NewToken{}, err
	}
	return tok, nil
}

// CreateToken makes a token that never expires, without an audit entry:
// for fixtures (tests, benchmarks). An operator's token is made with
// Create, which records who made it.
func CreateToken(ctx context.Context, q pgdb.Querier, name string, role Role, tenants []string) (NewToken, error) {
	return insertToken(ctx, q, TokenSpec{Name: name, Role: role, Tenants: tenants}, "")
}

// tokenDetails are what the audit log keeps of a new token: never its
// secret nor its hash.
func tokenDetails(tok NewToken) map[string]any {
	d := map[string]any{"role": tok.Role}
	if tok.Tenants != nil {
		d["tenants"] = tok.Tenants
	}
	if tok.Corrections {
		d["corrections"] = true
	}
	if tok.ExpiresAt != nil {
		d["expires_at"] = tok.ExpiresAt.UTC()
	}
	return d
}

// insertToken stores a token of spec with a fresh secret; origin is
// where its value comes from ("" for a generated one).
func insertToken(ctx context.Context, q pgdb.Querier, spec TokenSpec, origin Origin) (NewToken, error) {
	var raw [32]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return NewToken{}, fmt.Errorf("auth: generating a token: %w", err)
	}
	return storeToken(ctx, q, spec, origin, TokenPrefix+base64.RawURLEncoding.EncodeToString(raw[:]))
}

// storeToken stores a token of spec with the secret.
func storeToken(ctx context.Context, q pgdb.Querier, spec TokenSpec, origin Origin, secret string) (NewToken, error) {
	if rank[spec.Role] == 0 {
		return NewToken{}, fmt.Errorf("auth: unknown role %q", spec.Role)
	}
	if !namePattern.MatchString(spec.Name) {
		return NewToken{}, errors.New("auth: a token name is 1 to 100 printable characters")
	}
	if len(spec.Tenants) > 0 && spec.Role != RoleIngest {
		return NewToken{}, errors.New("auth: only an ingest token may be scoped to tenants")
	}
	hash := sha256.Sum256([]byte(secret))
	var scope []string
	if len(spec.Tenants) > 0 {
		scope = slices.Clone(spec.Tenants)
	}
	var (
		id      int64
		expires *time.Time
		// An operator or admin always may correct; its row says so.
		corrections = spec.Corrections || spec.Role.Allows(RoleOperator)
	)
	err := q.QueryRow(ctx, `INSERT INTO api_tokens (name, role, tenants, token_hash, origin, expires_at, corrections)
		VALUES ($1, $2, $3, $4, nullif($5, ''), CASE WHEN $6::interval > '0' THEN clock_timestamp() + $6::interval END, $7)
		RETURNING id, expires_at`,
		spec.Name, string(spec.Role), scope, hash[:], string(origin), spec.ExpiresIn, corrections).Scan(&id, &expires)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.ConstraintName == "api_tokens_name_key" {
			return NewToken{}, fmt.Errorf("auth: a token named %q exists already", spec.Name)
		}
		return NewToken{}, fmt.Errorf("auth: storing the token: %w", err)
	}
	return NewToken{Principal: Principal{TokenID: id, Name: spec.Name, Role: spec.Role, Tenants: scope, Corrections: corrections},
		Secret: secret, ExpiresAt: expires}, nil
}

// LastUsedResolution is how stale a token's last_used_at may grow: it is
// written at most once per this, per token.
const LastUsedResolution = time.Minute

// Verify returns the principal of a live presented token: not revoked, not
// expired (by the database's clock). The lookup is by the token's SHA-256,
// and the stored hash is then compared in constant time, so neither the
// database index nor Go's comparison reveals how much of a guess was right.
//
// It notes the token's use (last_used_at) at most once per
// LastUsedResolution, in a statement of its own whose failure does not fail
// the verification: pass a pool, not a transaction.
func Verify(ctx context.Context, q pgdb.Querier, presented string) (Principal, error) {
	if presented == "" || len(presented) > 512 {
		return Principal{}, ErrUnknownToken
	}
	hash := sha256.Sum256([]byte(presented))
	var (
		p      Principal
		stored []byte
		role   string
		stale  bool
	)
	err := q.QueryRow(ctx, `SELECT id, name, role, tenants, corrections, token_hash,
			last_used_at IS NULL OR last_used_at < clock_timestamp() - $2::interval
		FROM api_tokens
		WHERE token_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > clock_timestamp())`,
		hash[:], LastUsedResolution).Scan(&p.TokenID, &p.Name, &role, &p.Tenants, &p.Corrections, &stored, &stale)
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
	if stale {
		// Best effort: a token in use by another request right now is
		// skipped, not waited for, and an error here only delays the note.
		_, _ = q.Exec(ctx, `UPDATE api_tokens SET last_used_at = clock_timestamp()
			WHERE id = (SELECT id FROM api_tokens WHERE id = $1
				AND (last_used_at IS NULL OR last_used_at < clock_timestamp() - $2::interval) FOR UPDATE SKIP LOCKED)`,
			p.TokenID, LastUsedResolution)
	}
	return p, nil
}

// RevokeAs ends the live token named name and records who did it (by) in
// the audit log, in one transaction. Its console sessions end with it.
func RevokeAs(ctx context.Context, db pgdb.Beginner, name, by string) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := Revoke(ctx, tx, name); err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionTokenRevoke, Subject: audit.Token(name),
			From: "live", To: "revoked"})
	})
}

// Revoke ends the live token named name, without an audit entry: for
// fixtures. An operator revokes with RevokeAs.
func Revoke(ctx context.Context, q pgdb.Querier, name string) error {
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
	Tenants []string
	// Corrections says it may post corrections (negative values): always
	// for an operator or admin token.
	Corrections bool
	// Origin is where its value comes from: OriginConfig, OriginDev, or ""
	// for a token made with tally tokens create.
	Origin    Origin
	CreatedAt time.Time
	// RevokedAt is nil while the token is live.
	RevokedAt *time.Time
	// ExpiresAt is when it stops working; nil: never.
	ExpiresAt *time.Time
	// LastUsedAt is when it last verified, to within LastUsedResolution;
	// nil: never.
	LastUsedAt *time.Time
}

// ListTokens lists every token, the revoked ones too, oldest first.
func ListTokens(ctx context.Context, q pgdb.Querier) ([]Token, error) {
	rows, err := q.Query(ctx, `SELECT name, role, tenants, corrections, coalesce(origin, ''), created_at, revoked_at, expires_at, last_used_at
		FROM api_tokens ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("auth: listing tokens: %w", err)
	}
	tokens, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Token, error) {
		var (
			t            Token
			role, origin string
		)
		err := row.Scan(&t.Name, &role, &t.Tenants, &t.Corrections, &origin, &t.CreatedAt, &t.RevokedAt, &t.ExpiresAt, &t.LastUsedAt)
		t.Role, t.Origin = Role(role), Origin(origin)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("auth: listing tokens: %w", err)
	}
	return tokens, nil
}
