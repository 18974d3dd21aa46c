package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/archive"
	"github.com/tallymeter/tally/quarantine"
)

// archiveFlags are the flags of tally archive and tally archive verify.
type archiveFlags struct {
	newGeneration bool
	generation    int
	format        string
}

// archiveCommand is tally archive PERIOD: a closed month's files and
// manifest written to TALLY_ARCHIVE_URL (package archive).
func archiveCommand() command {
	f := &archiveFlags{}
	return command{name: "archive",
		flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&f.newGeneration, "new-generation", false, "write another generation beside a verified one (never over it)")
			fs.StringVar(&f.format, "format", "table", "table or json")
		},
		args: exactly(1, "a period, YYYY-MM"),
		run: func(ctx context.Context, e *env, args []string) error {
			if _, _, err := quarantine.ParsePeriod(args[0]); err != nil {
				return usageError{err.Error()}
			}
			limitMemory()
			cfg, err := archiveConfig(ctx, e)
			if err != nil {
				return err
			}
			cfg.NewGeneration = f.newGeneration
			pool, err := ownerPool(e)
			if err != nil {
				return err
			}
			res, err := archive.Archive(ctx, pool, args[0], cfg)
			if err != nil {
				return err
			}
			if f.format == "json" {
				return printJSON(e.stdout, res.Manifest)
			}
			fmt.Fprintf(e.stdout, "archived %s generation %d to %s (manifest sha256 %s)\n", args[0], res.Manifest.Generation,
				res.Manifest.Location, res.ManifestSHA256)
			for _, file := range res.Manifest.Files {
				fmt.Fprintf(e.stdout, "  %-34s %10d rows %12d bytes  %s\n", file.Name, file.Rows, file.Bytes, file.SHA256)
			}
			fmt.Fprintf(e.stdout, "next: tally archive verify %s\n", args[0])
			return nil
		},
	}
}

// archiveVerifyCommand is tally archive verify PERIOD.
func archiveVerifyCommand() command {
	f := &archiveFlags{}
	return command{name: "archive verify",
		flags: func(fs *flag.FlagSet) {
			fs.IntVar(&f.generation, "generation", 0, "the generation to verify (default: the latest)")
			fs.StringVar(&f.format, "format", "table", "table or json")
		},
		args: exactly(1, "a period, YYYY-MM"),
		run: func(ctx context.Context, e *env, args []string) error {
			if _, _, err := quarantine.ParsePeriod(args[0]); err != nil {
				return usageError{err.Error()}
			}
			if f.generation < 0 {
				return usageError{"--generation must be positive"}
			}
			limitMemory()
			cfg, err := archiveConfig(ctx, e)
			if err != nil {
				return err
			}
			pool, err := ownerPool(e)
			if err != nil {
				return err
			}
			v, err := archive.Verify(ctx, pool, args[0], f.generation, cfg)
			var ve *archive.VerifyError
			if errors.As(err, &ve) {
				for _, p := range ve.Problems {
					fmt.Fprintf(e.stderr, "  %s\n", p)
				}
			}
			if err != nil {
				return err
			}
			if f.format == "json" {
				return printJSON(e.stdout, v)
			}
			fmt.Fprintf(e.stdout, "verified %s generation %d: %d rows, %d bytes re-read; state %s (compared with the database: %v)\n",
				v.Period, v.Generation, v.Rows, v.Bytes, v.State, v.ComparedWithDatabase)
			return nil
		},
	}
}

// archiveDetachCommand is tally archive detach PERIOD: the ledger's month
// leaves the database once the archives of the periods it holds are
// verified.
func archiveDetachCommand() command {
	f := &archiveFlags{}
	return command{name: "archive detach",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&f.format, "format", "table", "table or json")
		},
		args: exactly(1, "a period, YYYY-MM"),
		run: func(ctx context.Context, e *env, args []string) error {
			if _, _, err := quarantine.ParsePeriod(args[0]); err != nil {
				return usageError{err.Error()}
			}
			pool, err := ownerPool(e)
			if err != nil {
				return err
			}
			res, err := archive.Detach(ctx, pool, args[0], who())
			if err != nil {
				return err
			}
			if f.format == "json" {
				return printJSON(e.stdout, res)
			}
			if res.Partition != "" {
				fmt.Fprintf(e.stdout, "detached and dropped %s (%d events)\n", res.Partition, res.Events)
			} else {
				fmt.Fprintf(e.stdout, "the ledger's month %s had left already\n", args[0])
			}
			for _, p := range res.Periods {
				fmt.Fprintf(e.stdout, "period %s has left the database: its report answers from its archive\n", p)
			}
			return nil
		},
	}
}

// limitMemory sets archive.MemoryLimit as the process's soft memory
// limit, unless GOMEMLIMIT sets one.
func limitMemory() {
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(archive.MemoryLimit)
	}
}

// archiveRestoreCommand is tally archive restore PERIOD --schema S: the
// month's files loaded into a new schema of their own, for an audit.
func archiveRestoreCommand() command {
	f := &archiveFlags{}
	var schema string
	return command{name: "archive restore",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&schema, "schema", "", "the new schema to load the month into (required)")
			fs.IntVar(&f.generation, "generation", 0, "the generation to restore (default: the latest this database knows)")
		},
		args: exactly(1, "a period, YYYY-MM"),
		run: func(ctx context.Context, e *env, args []string) error {
			if _, _, err := quarantine.ParsePeriod(args[0]); err != nil {
				return usageError{err.Error()}
			}
			if schema == "" || f.generation < 0 {
				return usageError{"--schema is required; --generation must be positive"}
			}
			limitMemory()
			cfg, err := archiveConfig(ctx, e)
			if err != nil {
				return err
			}
			pool, err := ownerPool(e)
			if err != nil {
				return err
			}
			res, err := archive.Restore(ctx, pool, cfg.Store, args[0], f.generation, schema)
			if err != nil {
				return err
			}
			fmt.Fprintf(e.stdout, "restored %s generation %d into schema %s\n", args[0], res.Generation, res.Schema)
			for table, n := range res.Rows {
				fmt.Fprintf(e.stdout, "  %-26s %10d rows\n", table, n)
			}
			return nil
		},
	}
}

// archiveConfig opens the store the settings name: TALLY_ARCHIVE_URL, or
// the directory "archive" in the data directory.
func archiveConfig(ctx context.Context, e *env) (archive.Config, error) {
	raw := e.cfg.ArchiveURL
	if raw == "" {
		raw = filepath.Join(e.cfg.DataDir, "archive")
	}
	store, err := archive.OpenStore(ctx, raw, archive.S3Options{Endpoint: e.cfg.ArchiveEndpoint, Region: e.cfg.ArchiveRegion,
		AccessKey: e.cfg.ArchiveAccessKey, SecretKey: e.cfg.ArchiveSecretKey})
	if err != nil {
		return archive.Config{}, err
	}
	return archive.Config{Store: store, InvoiceGrace: e.cfg.InvoiceGrace, By: who()}, nil
}

// ownerPool is the pool the archive commands run on: the database's owner
// role (TALLY_DATABASE_OWNER_URL, or TALLY_DATABASE_URL's role on a
// single-role install), since the runtime role may not detach or drop. It
// refuses a pooled database: a period's lock is a session's, which a
// transaction-mode pooler would share with other clients.
func ownerPool(e *env) (*pgxpool.Pool, error) {
	if e.cfg.DatabasePooled {
		return nil, usageError{"the archive commands hold a session's lock and cannot run through a transaction-mode pooler: " +
			"unset TALLY_DATABASE_POOLED and point TALLY_DATABASE_URL (or TALLY_DATABASE_OWNER_URL) straight at Postgres"}
	}
	return e.db.Pool, nil
}
