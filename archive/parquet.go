package archive

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/parquet-go/parquet-go"
)

// batchRows is how many rows one FETCH of the archive's cursor reads, and
// rowGroupRows how many rows make a Parquet row group: what the writer
// holds in memory is one row group of one file (a few tens of MB for the
// widest file, item bodies), whatever the period's size.
const (
	batchRows    = 10_000
	rowGroupRows = 32_768
)

// MemoryLimit is the soft memory limit (runtime/debug.SetMemoryLimit) tally
// archive and tally archive verify run under unless GOMEMLIMIT sets one:
// their live heap is about one row group of one file whatever the month's
// size, and the limit keeps the garbage collector's slack from growing it
// (docs/performance.md).
const MemoryLimit = 192 << 20

// schemaOf is the Parquet schema of f: every column optional (NULL is
// kept as NULL), each with its exact type.
func schemaOf(f file) *parquet.Schema {
	g := parquet.Group{}
	for _, c := range f.columns {
		var n parquet.Node
		switch c.kind {
		case kindInt64:
			n = parquet.Int(64)
		case kindInt32:
			n = parquet.Int(32)
		case kindText, kindDecimal:
			n = parquet.String()
		case kindBool:
			n = parquet.Leaf(parquet.BooleanType)
		case kindTime:
			n = parquet.Timestamp(parquet.Microsecond)
		case kindJSON:
			n = parquet.JSON()
		}
		g[c.name] = parquet.Optional(n)
	}
	return parquet.NewSchema(f.table, g)
}

// leafIndexes maps f's columns, in f's order, to the schema's column
// indexes (a Parquet group orders its fields by name).
func leafIndexes(s *parquet.Schema, f file) ([]int, error) {
	out := make([]int, len(f.columns))
	for i, c := range f.columns {
		leaf, ok := s.Lookup(c.name)
		if !ok {
			return nil, fmt.Errorf("archive: %s has no column %s", f.name, c.name)
		}
		out[i] = leaf.ColumnIndex
	}
	return out, nil
}

// hashCounter counts and hashes what passes through it.
type hashCounter struct {
	w     io.Writer
	h     hash.Hash
	bytes int64
}

func (c *hashCounter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.h.Write(b[:n])
	c.bytes += int64(n)
	return n, err
}

// written is what writing one file produced, for the manifest.
type written struct {
	rows, bytes  int64
	sha256       string
	minID, maxID *int64
}

// writeFile streams f's rows from the snapshot tx into the store under
// name: a cursor fetched batchRows at a time, written row group by row
// group, hashed on the way. The object is committed only when complete.
func writeFile(ctx context.Context, tx pgx.Tx, store Store, name string, f file, args pgx.NamedArgs) (written, error) {
	schema := schemaOf(f)
	leaves, err := leafIndexes(schema, f)
	if err != nil {
		return written{}, err
	}
	idCol := -1
	for i, c := range f.columns {
		if c.name == f.idColumn {
			idCol = i
		}
	}
	pending, err := store.Create(ctx, name)
	if err != nil {
		return written{}, err
	}
	committed := false
	defer func() {
		if !committed {
			pending.Abort()
		}
	}()
	hc := &hashCounter{w: pending, h: sha256.New()}
	w := parquet.NewWriter(hc, schema, parquet.Compression(&parquet.Zstd), parquet.MaxRowsPerRowGroup(rowGroupRows),
		parquet.CreatedBy("tally", "archive", "1"))

	cursor := "archive_" + f.table
	if _, err := tx.Exec(ctx, "DECLARE "+cursor+" NO SCROLL CURSOR FOR "+f.query, args); err != nil {
		return written{}, fmt.Errorf("archive: reading %s: %w", f.table, err)
	}
	var out written
	batch := make([]parquet.Row, 0, batchRows)
	for {
		rows, err := tx.Query(ctx, fmt.Sprintf("FETCH FORWARD %d FROM %s", batchRows, cursor))
		if err != nil {
			return written{}, fmt.Errorf("archive: reading %s: %w", f.table, err)
		}
		batch = batch[:0]
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				rows.Close()
				return written{}, fmt.Errorf("archive: reading %s: %w", f.table, err)
			}
			row := make(parquet.Row, len(f.columns))
			for i, v := range vals {
				pv, err := toParquet(f.columns[i], v)
				if err != nil {
					rows.Close()
					return written{}, fmt.Errorf("archive: %s.%s: %w", f.table, f.columns[i].name, err)
				}
				def := 1
				if pv.IsNull() {
					def = 0
				}
				row[leaves[i]] = pv.Level(0, def, leaves[i])
			}
			if idCol >= 0 && vals[idCol] != nil {
				id := asInt64(vals[idCol])
				if out.minID == nil || id < *out.minID {
					out.minID = &id
				}
				if out.maxID == nil || id > *out.maxID {
					out.maxID = &id
				}
			}
			batch = append(batch, row)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return written{}, fmt.Errorf("archive: reading %s: %w", f.table, err)
		}
		if len(batch) == 0 {
			break
		}
		if _, err := w.WriteRows(batch); err != nil {
			return written{}, fmt.Errorf("archive: writing %s: %w", name, err)
		}
		out.rows += int64(len(batch))
		if len(batch) < batchRows {
			break
		}
	}
	if _, err := tx.Exec(ctx, "CLOSE "+cursor); err != nil {
		return written{}, fmt.Errorf("archive: reading %s: %w", f.table, err)
	}
	if err := w.Close(); err != nil {
		return written{}, fmt.Errorf("archive: writing %s: %w", name, err)
	}
	if err := pending.Commit(); err != nil {
		return written{}, err
	}
	committed = true
	out.bytes, out.sha256 = hc.bytes, hex.EncodeToString(hc.h.Sum(nil))
	return out, nil
}

func asInt64(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case int32:
		return int64(n)
	case int16:
		return int64(n)
	}
	return 0
}

// toParquet converts a value pgx decoded into c's Parquet value.
func toParquet(c column, v any) (parquet.Value, error) {
	if v == nil {
		return parquet.NullValue(), nil
	}
	switch c.kind {
	case kindInt64:
		switch n := v.(type) {
		case int64, int32, int16:
			return parquet.Int64Value(asInt64(n)), nil
		}
	case kindInt32:
		switch n := v.(type) {
		case int32:
			return parquet.Int32Value(n), nil
		case int16:
			return parquet.Int32Value(int32(n)), nil
		}
	case kindText, kindDecimal, kindJSON:
		if s, ok := v.(string); ok {
			return parquet.ByteArrayValue([]byte(s)), nil
		}
	case kindBool:
		if b, ok := v.(bool); ok {
			return parquet.BooleanValue(b), nil
		}
	case kindTime:
		if t, ok := v.(time.Time); ok {
			return parquet.Int64Value(t.UTC().UnixMicro()), nil
		}
	}
	return parquet.Value{}, fmt.Errorf("unexpected %T", v)
}

// record is one row read back from an archive file, by column name.
type record struct {
	row   parquet.Row
	index map[string]int
}

func (r record) value(name string) parquet.Value {
	i, ok := r.index[name]
	if !ok {
		return parquet.NullValue()
	}
	return r.row[i]
}

// Null says whether the column is NULL.
func (r record) null(name string) bool { return r.value(name).IsNull() }

func (r record) int(name string) int64 {
	v := r.value(name)
	if v.IsNull() {
		return 0
	}
	if v.Kind() == parquet.Int32 {
		return int64(v.Int32())
	}
	return v.Int64()
}

func (r record) str(name string) string {
	v := r.value(name)
	if v.IsNull() {
		return ""
	}
	return string(v.ByteArray())
}

// fileReader streams the rows of one archive file, row group by row
// group, batchRows at a time.
type fileReader struct {
	file  *parquet.File
	rows  parquet.Rows
	group int
	buf   []parquet.Row
	at    int
	index map[string]int
	read  int64
}

// openRows opens obj as f's Parquet file and checks that its columns are
// f's.
func openRows(obj Object, f file) (*fileReader, error) {
	pf, err := parquet.OpenFile(obj, obj.Size(), parquet.SkipBloomFilters(true), parquet.SkipPageIndex(true))
	if err != nil {
		return nil, fmt.Errorf("%s: not a readable Parquet file: %w", f.name, err)
	}
	index := map[string]int{}
	for _, c := range f.columns {
		leaf, ok := pf.Schema().Lookup(c.name)
		if !ok {
			return nil, fmt.Errorf("%s: no column %s", f.name, c.name)
		}
		index[c.name] = leaf.ColumnIndex
	}
	if n := len(pf.Schema().Columns()); n != len(f.columns) {
		return nil, fmt.Errorf("%s: %d columns, want %d", f.name, n, len(f.columns))
	}
	return &fileReader{file: pf, index: index, buf: make([]parquet.Row, 0, batchRows)}, nil
}

// next is the next record; ok is false at the end of the file. A record
// is valid until the following call.
func (r *fileReader) next() (record, bool, error) {
	for r.at >= len(r.buf) {
		if r.rows == nil {
			groups := r.file.RowGroups()
			if r.group >= len(groups) {
				return record{}, false, nil
			}
			r.rows = groups[r.group].Rows()
			r.group++
		}
		n, err := r.rows.ReadRows(r.buf[:cap(r.buf)])
		r.buf, r.at = r.buf[:n], 0
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return record{}, false, err
			}
			_ = r.rows.Close()
			r.rows = nil
		}
	}
	rec := record{row: r.buf[r.at], index: r.index}
	r.at++
	r.read++
	return rec, true, nil
}

// close releases the reader.
func (r *fileReader) close() {
	if r.rows != nil {
		_ = r.rows.Close()
	}
}

// footerRows is the row count the file's footer records.
func (r *fileReader) footerRows() int64 { return r.file.NumRows() }
