package main

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// tally archive refuses a month that is still open and a malformed one;
// an empty closed month archives (every file, no rows) and verifies, and
// the files land under TALLY_ARCHIVE_URL.
func TestArchiveCommands(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	dir := t.TempDir()
	env := []string{"TALLY_DATABASE_URL=" + url, "TALLY_ARCHIVE_URL=" + dir, "TALLY_INVOICE_GRACE=0s"}
	now := time.Now().UTC()
	current := now.Format("2006-01")
	last := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC).AddDate(0, -1, 0).Format("2006-01")

	code, _, errs := tallyEnv(t, env, "archive", "2026-13")
	require.Equal(t, 2, code, errs)

	// Through a transaction-mode pooler the period's session lock could be
	// shared with another client: every archive command refuses, and
	// nothing is written.
	pooled := append(slices.Clone(env), "TALLY_DATABASE_POOLED=true")
	for _, args := range [][]string{{"archive", last}, {"archive", "verify", last}, {"archive", "detach", last},
		{"archive", "restore", last, "--schema", "audit_pooled"}} {
		code, _, errs = tallyEnv(t, pooled, args...)
		require.Equal(t, 2, code, "%v: %s", args, errs)
		require.Contains(t, errs, "cannot run through a transaction-mode pooler", args)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries)
	code, _, errs = tallyEnv(t, env, "archive", "verify", last)
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "no archive of "+last)

	code, _, errs = tallyEnv(t, env, "archive", current)
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "archive "+current+" refused: the period is still open")

	code, out, errs := tallyEnv(t, env, "archive", last)
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "archived "+last+" generation 1")
	require.FileExists(t, filepath.Join(dir, last, "g0001", "manifest.json"))
	code, out, errs = tallyEnv(t, env, "archive", "verify", last)
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "verified "+last+" generation 1")
	require.Contains(t, out, "state verified")

	code, out, errs = tallyEnv(t, env, "archive", "restore", last, "--schema", "audit_last")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "restored "+last+" generation 1 into schema audit_last")
	code, _, errs = tallyEnv(t, env, "archive", "restore", last)
	require.Equal(t, 2, code, errs)

	// Damage fails verify with the file named.
	require.NoError(t, os.Remove(filepath.Join(dir, last, "g0001", "audit_log.parquet")))
	code, _, errs = tallyEnv(t, env, "archive", "verify", last)
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "audit_log.parquet: missing")
}
