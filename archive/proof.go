package archive

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/quarantine"
)

// ErrNotVerified says a period has no verified archive: it may not leave
// the database.
var ErrNotVerified = errors.New("archive: no verified archive")

// Proof is what a detach needs to know about a period's verified archive.
type Proof struct {
	Period         string
	Generation     int
	VerifiedAt     time.Time
	ManifestSHA256 string
	Location       string
	// Files are the manifest's files: row counts and id ranges, for a
	// detach that checks the partitions it drops hold what was archived.
	Files []File
	// LedgerMonths are the manifest's counts of the archived ledger rows
	// by the month they occurred in.
	LedgerMonths map[string]int64
}

// Verified is the proof that period's latest archive generation is
// verified (or already detached), or ErrNotVerified. Call it in the
// detach's transaction, with the period's lock held, so that the proof
// and the drop are one decision.
func Verified(ctx context.Context, q pgdb.Querier, period string) (Proof, error) {
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		return Proof{}, err
	}
	rec, err := latestArchive(ctx, q, period)
	if err != nil {
		return Proof{}, err
	}
	if rec == nil {
		return Proof{}, fmt.Errorf("%w of %s: run tally archive %s, then tally archive verify %s", ErrNotVerified, period, period, period)
	}
	if rec.State == StateWritten || rec.VerifiedAt == nil {
		return Proof{}, fmt.Errorf("%w of %s: generation %d is %s; run tally archive verify %s", ErrNotVerified, period,
			rec.Generation, rec.State, period)
	}
	var m Manifest
	if err := json.Unmarshal(rec.Manifest, &m); err != nil {
		return Proof{}, fmt.Errorf("archive: manifest of %s: %w", period, err)
	}
	return Proof{Period: period, Generation: rec.Generation, VerifiedAt: *rec.VerifiedAt, ManifestSHA256: rec.ManifestSHA256,
		Location: rec.Location, Files: m.Files, LedgerMonths: m.LedgerMonths}, nil
}

// MarkDetached records, in the detach's transaction tx, that the period
// of proof left the database, and audits it. It refuses (ErrNotVerified)
// unless that generation is still verified.
func MarkDetached(ctx context.Context, tx pgx.Tx, proof Proof, by string) error {
	tag, err := tx.Exec(ctx, `UPDATE archives SET state = 'detached', detached_at = clock_timestamp(), detached_by = $3
		WHERE period = $1 AND generation = $2 AND state = 'verified'`, proof.Period, proof.Generation, by)
	if err != nil {
		return fmt.Errorf("archive: marking %s detached: %w", proof.Period, err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w: %s generation %d is not verified", ErrNotVerified, proof.Period, proof.Generation)
	}
	return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: ActionDetach, Subject: Subject(proof.Period),
		From: string(StateVerified), To: string(StateDetached),
		Details: map[string]any{"generation": proof.Generation, "manifest_sha256": proof.ManifestSHA256}})
}

// DetachedReport answers the completeness report of period from the manifest
// the archives table keeps, once the period is detached (ok true); it
// reads nothing else (ok false) before. It is what a node's report of the
// month answers (quarantine.Reports.Archived).
func DetachedReport(ctx context.Context, q pgdb.Beginner, period string) (quarantine.Completeness, bool, error) {
	rec, err := detachedArchive(ctx, q, period)
	if err != nil || rec == nil {
		return quarantine.Completeness{}, false, err
	}
	var m Manifest
	if err := json.Unmarshal(rec.Manifest, &m); err != nil {
		return quarantine.Completeness{}, true, fmt.Errorf("archive: manifest of %s: %w", period, err)
	}
	return m.Completeness, true, nil
}

// Completeness answers the completeness report of period from its
// archive once the period is detached (archived true): the manifest's
// totals, read from store when one is given (and checked against the
// archives table's sha256) or else from the table's copy. Before that it
// is quarantine.CompletenessOf over the database (archived false).
func Completeness(ctx context.Context, q pgdb.Beginner, store Store, period string) (quarantine.Completeness, bool, error) {
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		return quarantine.Completeness{}, false, err
	}
	rec, err := detachedArchive(ctx, q, period)
	if err != nil {
		return quarantine.Completeness{}, false, err
	}
	if rec == nil {
		c, err := quarantine.CompletenessOf(ctx, q, period, "")
		return c, false, err
	}
	body := rec.Manifest
	if store != nil {
		sum, _, err := hashObject(ctx, store, prefix(period, rec.Generation)+"/"+manifestName)
		if err != nil {
			return quarantine.Completeness{}, true, fmt.Errorf("archive: manifest of %s: %w", period, err)
		}
		if sum != rec.ManifestSHA256 {
			return quarantine.Completeness{}, true, fmt.Errorf("archive: manifest of %s: sha256 %s, the archives table says %s",
				period, sum, rec.ManifestSHA256)
		}
	}
	var m Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		return quarantine.Completeness{}, true, fmt.Errorf("archive: manifest of %s: %w", period, err)
	}
	return m.Completeness, true, nil
}

// detachedArchive is the detached generation of period, or nil.
func detachedArchive(ctx context.Context, q pgdb.Querier, period string) (*Record, error) {
	rec, err := latestArchive(ctx, q, period)
	if err != nil || rec == nil || rec.State != StateDetached {
		return nil, err
	}
	return rec, nil
}
