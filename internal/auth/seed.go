package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
)

// Origin is where a token's value comes from.
type Origin string

// Origins of a seeded token; a token made with Create has none ("").
const (
	// OriginConfig is the admin token TALLY_ADMIN_TOKEN seeds.
	OriginConfig Origin = "config"
	// OriginDev is the ingest token tally dev keeps in its data directory.
	OriginDev Origin = "dev"
)

// ErrSeedRevoked says a configured value is a token that was revoked: it
// stays revoked, and the node has no token from that value.
var ErrSeedRevoked = errors.New("auth: the configured token was revoked and is not revived")

// seedLock is the transaction-level advisory lock seeding holds, so that
// nodes starting together seed one at a time: "tokens" in ASCII.
const seedLock int64 = 0x746f6b656e73

// seedActor is who seeding is, in the audit log.
var seedActor = map[Origin]string{OriginConfig: "start:TALLY_ADMIN_TOKEN", OriginDev: "start:tally dev"}

// Seeded says what seeding a value did.
type Seeded struct {
	// Name is the token the value is (or was, when revoked).
	Name string
	// Created: the value was new and its token made now.
	Created bool
	// Revoked names the live tokens of the same origin the new value ended.
	Revoked []string
}

// SeedAdminToken seeds TALLY_ADMIN_TOKEN's admin token (see SeedToken),
// after checking the value's strength.
func SeedAdminToken(ctx context.Context, db pgdb.Beginner, secret string) (Seeded, error) {
	if err := CheckConfiguredSecret("TALLY_ADMIN_TOKEN", secret); err != nil {
		return Seeded{}, err
	}
	return SeedToken(ctx, db, OriginConfig, RoleAdmin, secret)
}

// SeedToken makes sure a value that comes from outside (configuration, a
// file) is a token of role, identifying the token by the value's hash:
//
//   - a live token with that hash: nothing changes;
//   - a revoked one: it stays revoked, and the answer is ErrSeedRevoked
//     with its name — a restart never revives a token;
//   - none: the value is new. It becomes a token named after its origin,
//     role and the first 8 hex digits of its hash, marked with its origin,
//     and every other live token of that origin (the previous value) is
//     revoked, its console sessions with it. It may post corrections
//     (TALLY_ADMIN_TOKEN's as every admin token; tally dev's so that a
//     developer can try them).
//
// All of it runs in one transaction under an advisory lock, and creation and
// revocation are recorded in the audit log in it. Nodes started with
// different values therefore agree: the newest value wins, and a node
// restarted with an older one finds that token revoked and leaves it so.
func SeedToken(ctx context.Context, db pgdb.Beginner, origin Origin, role Role, secret string) (Seeded, error) {
	if origin != OriginConfig && origin != OriginDev {
		return Seeded{}, fmt.Errorf("auth: seeding from unknown origin %q", origin)
	}
	if rank[role] == 0 {
		return Seeded{}, fmt.Errorf("auth: unknown role %q", role)
	}
	hash := sha256.Sum256([]byte(secret))
	actor := seedActor[origin]
	var out Seeded
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		out = Seeded{}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, seedLock); err != nil {
			return fmt.Errorf("auth: taking the token seeding lock: %w", err)
		}
		var (
			revoked bool
			has     string
		)
		err := tx.QueryRow(ctx, `SELECT name, role, revoked_at IS NOT NULL FROM api_tokens WHERE token_hash = $1`, hash[:]).
			Scan(&out.Name, &has, &revoked)
		switch {
		case err == nil && revoked:
			return ErrSeedRevoked
		case err == nil && Role(has) != role:
			return fmt.Errorf("auth: the configured value is the %s token %q, not one of role %s", has, out.Name, role)
		case err == nil:
			return nil
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("auth: reading tokens: %w", err)
		}

		name := fmt.Sprintf("%s-%s-%x", origin, role, hash[:4])
		// tally dev's token posts what a developer tries, corrections
		// included; an admin token may anyway.
		tok, err := storeToken(ctx, tx, TokenSpec{Name: name, Role: role, Corrections: origin == OriginDev}, origin, secret)
		if err != nil {
			return err
		}
		details := tokenDetails(tok)
		details["origin"] = origin
		if err := audit.Record(ctx, tx, audit.Entry{Actor: actor, Action: audit.ActionTokenCreate, Subject: audit.Token(name),
			To: "live", Reason: "a new configured value", Details: details}); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `UPDATE api_tokens SET revoked_at = clock_timestamp()
			WHERE origin = $1 AND revoked_at IS NULL AND id <> $2 RETURNING name`, string(origin), tok.TokenID)
		if err != nil {
			return fmt.Errorf("auth: revoking the previous configured token: %w", err)
		}
		if out.Revoked, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return fmt.Errorf("auth: revoking the previous configured token: %w", err)
		}
		for _, old := range out.Revoked {
			if err := audit.Record(ctx, tx, audit.Entry{Actor: actor, Action: audit.ActionTokenRevoke, Subject: audit.Token(old),
				From: "live", To: "revoked", Reason: "replaced by a new configured value: " + name}); err != nil {
				return err
			}
		}
		out.Name, out.Created = name, true
		return nil
	})
	if errors.Is(err, ErrSeedRevoked) {
		return Seeded{Name: out.Name}, err
	}
	if err != nil {
		return Seeded{}, err
	}
	return out, nil
}
