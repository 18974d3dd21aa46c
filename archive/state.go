package archive

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// State is an archive generation's place in its lifecycle.
type State string

// The states of an archive generation: they only move forward.
const (
	// StateWritten: every file and the manifest are committed.
	StateWritten State = "written"
	// StateVerified: Verify re-read every file and every total matched.
	StateVerified State = "verified"
	// StateDetached: the period's partitions were dropped after it was
	// verified.
	StateDetached State = "detached"
)

// Record is one row of the archives table.
type Record struct {
	Period         string
	Generation     int
	State          State
	Location       string
	ManifestSHA256 string
	Manifest       []byte
	WrittenAt      time.Time
	WrittenBy      string
	VerifiedAt     *time.Time
	DetachedAt     *time.Time
}

const sqlLatest = `
SELECT period, generation, state, location, manifest_sha256, manifest::text, written_at, written_by, verified_at, detached_at
FROM archives WHERE period = $1 AND ($2 = 0 OR generation = $2) ORDER BY generation DESC LIMIT 1`

// latestArchive is the latest generation of period's archive, or nil.
func latestArchive(ctx context.Context, q pgdb.Querier, period string) (*Record, error) {
	return archiveOf(ctx, q, period, 0)
}

// archiveOf is generation gen of period's archive (0: the latest), or nil.
func archiveOf(ctx context.Context, q pgdb.Querier, period string, gen int) (*Record, error) {
	var r Record
	var manifest string
	err := q.QueryRow(ctx, sqlLatest, period, gen).Scan(&r.Period, &r.Generation, &r.State, &r.Location, &r.ManifestSHA256,
		&manifest, &r.WrittenAt, &r.WrittenBy, &r.VerifiedAt, &r.DetachedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("archive: reading the archives of %s: %w", period, err)
	}
	r.Manifest = []byte(manifest)
	return &r, nil
}
