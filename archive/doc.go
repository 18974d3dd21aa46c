// Package archive owns the archives of closed billing periods: `tally
// archive PERIOD` writes a month's ledger rows, items, attempts and
// evidence as Parquet files with a manifest (per file its rows, bytes and
// sha256; the id ranges archived; the month's completeness totals) to a
// directory or an S3-compatible bucket (Store), and `tally archive verify
// PERIOD` re-reads them. It owns the archives table (one row per
// generation: written, verified, detached) and audits every archive and
// verification.
//
// Lifecycle of a generation (docs/archive.md):
//
//	Archive ──▶ written ──Verify──▶ verified ──MarkDetached──▶ detached
//	              │ (a failed Verify leaves it written)
//
// Archive refuses a period that is still open (its end plus the invoice
// grace ahead, for any tenant), whose items are not all terminal
// (confirmed, withdrawn, rejected with a reason, superseded by a terminal
// successor), with unstaged events or open discrepancies, or whose
// completeness report does not hold. It reads one REPEATABLE READ snapshot
// and streams: a cursor fetched in batches, written row group by row
// group, so its memory does not grow with the period. Verified gives the
// detach its proof; Completeness answers a detached period's report from
// its manifest; Restore loads an archive into a schema of its own for an
// audit.
//
// It must never delete or change a ledger or outbox row (nothing here
// writes any table but archives and the audit log), never overwrite a
// committed file or a verified generation, and never mark a generation
// verified without re-reading every file and recomputing its totals.
package archive
