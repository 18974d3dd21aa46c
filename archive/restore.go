package archive

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// schemaPattern is what a restore's schema may be called: a plain
// lower-case identifier that is not one of Tally's or Postgres's own.
var schemaPattern = regexp.MustCompile(`^[a-z][a-z0-9_]{0,62}$`)

// Restored is what Restore loaded.
type Restored struct {
	Schema     string
	Generation int
	// Rows are the rows loaded, by table.
	Rows map[string]int64
}

// Restore loads generation gen of period's archive from store into a new
// schema of its own, one table per file with the file's columns (for an
// audit: never into Tally's tables). gen 0 is the latest generation the
// archives table names. Every file's sha256 is checked against the
// manifest (and the manifest's against the archives table, when it names
// the generation) before anything is loaded; rows are streamed into the
// tables with COPY, in one transaction: a failure leaves no schema.
func Restore(ctx context.Context, pool *pgxpool.Pool, store Store, period string, gen int, schema string) (Restored, error) {
	if !schemaPattern.MatchString(schema) || schema == "public" || strings.HasPrefix(schema, "pg_") || schema == "information_schema" {
		return Restored{}, fmt.Errorf("archive: restore into %q: want a new schema of its own (lower-case letters, digits, _)", schema)
	}
	rec, err := archiveOf(ctx, pool, period, gen)
	if err != nil {
		return Restored{}, err
	}
	if rec == nil && gen == 0 {
		return Restored{}, fmt.Errorf("archive: no archive of %s in this database: name its generation", period)
	}
	if rec == nil {
		rec = &Record{Period: period, Generation: gen}
	}
	base := prefix(period, rec.Generation) + "/"
	m, err := readManifest(ctx, store, base+manifestName, rec.ManifestSHA256)
	if err != nil {
		return Restored{}, err
	}
	for _, f := range m.Files {
		sum, _, err := hashObject(ctx, store, base+f.Name)
		if err != nil {
			return Restored{}, fmt.Errorf("archive: %s: %w", f.Name, err)
		}
		if sum != f.SHA256 {
			return Restored{}, fmt.Errorf("archive: %s: sha256 %s, the manifest says %s (run tally archive verify)", f.Name, sum, f.SHA256)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return Restored{}, fmt.Errorf("archive: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return Restored{}, fmt.Errorf("archive: restore into %s: %w", schema, err)
	}
	out := Restored{Schema: schema, Generation: rec.Generation, Rows: map[string]int64{}}
	for _, f := range m.Files {
		spec, ok := fileNamed(f.Name)
		if !ok {
			return Restored{}, fmt.Errorf("archive: %s: not a file of an archive", f.Name)
		}
		n, err := restoreFile(ctx, tx, store, base+f.Name, spec, schema)
		if err != nil {
			return Restored{}, fmt.Errorf("archive: restoring %s: %w", f.Name, err)
		}
		if n != f.Rows {
			return Restored{}, fmt.Errorf("archive: restoring %s: %d rows, the manifest says %d", f.Name, n, f.Rows)
		}
		out.Rows[spec.table] = n
	}
	if err := tx.Commit(ctx); err != nil {
		return Restored{}, fmt.Errorf("archive: %w", err)
	}
	return out, nil
}

// readManifest reads and parses a manifest, checking its sha256 when want
// is set.
func readManifest(ctx context.Context, store Store, name, want string) (Manifest, error) {
	obj, err := store.Open(ctx, name)
	if err != nil {
		return Manifest{}, err
	}
	defer func() { _ = obj.Close() }()
	b, err := io.ReadAll(io.LimitReader(obj, 256<<20))
	if err != nil {
		return Manifest{}, fmt.Errorf("archive: %s: %w", name, err)
	}
	if want != "" {
		if sum := sha256Hex(b); sum != want {
			return Manifest{}, fmt.Errorf("archive: %s: sha256 %s, the archives table says %s", name, sum, want)
		}
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return Manifest{}, fmt.Errorf("archive: %s: %w", name, err)
	}
	return m, nil
}

// sqlType is the Postgres type a column of kind k is restored as.
func sqlType(k kind) string {
	switch k {
	case kindInt64:
		return "bigint"
	case kindInt32:
		return "integer"
	case kindBool:
		return "boolean"
	case kindTime:
		return "timestamptz"
	case kindJSON:
		return "jsonb"
	case kindDecimal:
		return "numeric"
	}
	return "text"
}

// restoreFile creates f's table in schema and copies the file's rows into
// it, streaming.
func restoreFile(ctx context.Context, tx pgx.Tx, store Store, name string, f file, schema string) (int64, error) {
	cols := make([]string, len(f.columns))
	defs := make([]string, len(f.columns))
	for i, c := range f.columns {
		cols[i] = c.name
		defs[i] = pgx.Identifier{c.name}.Sanitize() + " " + sqlType(c.kind)
	}
	table := pgx.Identifier{schema, f.table}
	if _, err := tx.Exec(ctx, "CREATE TABLE "+table.Sanitize()+" ("+strings.Join(defs, ", ")+")"); err != nil {
		return 0, err
	}
	obj, err := store.Open(ctx, name)
	if err != nil {
		return 0, err
	}
	defer func() { _ = obj.Close() }()
	r, err := openRows(obj, f)
	if err != nil {
		return 0, err
	}
	defer r.close()
	vals := make([]any, len(f.columns))
	return tx.CopyFrom(ctx, table, cols, pgx.CopyFromFunc(func() ([]any, error) {
		rec, ok, err := r.next()
		if err != nil || !ok {
			return nil, err
		}
		for i, c := range f.columns {
			vals[i] = goValue(rec, c)
		}
		return vals, nil
	}))
}

// goValue is a record's column as pgx encodes it for the restored table.
func goValue(r record, c column) any {
	if r.null(c.name) {
		return nil
	}
	switch c.kind {
	case kindInt64:
		return r.int(c.name)
	case kindInt32:
		return int32(r.int(c.name))
	case kindBool:
		return r.value(c.name).Boolean()
	case kindTime:
		return time.UnixMicro(r.int(c.name)).UTC()
	case kindDecimal:
		var n pgtype.Numeric
		if err := n.Scan(r.str(c.name)); err != nil {
			return r.str(c.name)
		}
		return n
	}
	return r.str(c.name)
}
