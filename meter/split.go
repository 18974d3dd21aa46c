package meter

import (
	"context"
	"fmt"
	"math/big"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// numericToInt64 converts a window's exact sum; ok is false when it does not
// fit a signed 64-bit integer.
func numericToInt64(n pgtype.Numeric) (int64, bool) {
	if !n.Valid || n.NaN || n.InfinityModifier != 0 || n.Exp < 0 {
		return 0, false
	}
	v := new(big.Int).Set(n.Int)
	if n.Exp > 0 {
		v.Mul(v, new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(n.Exp)), nil))
	}
	if !v.IsInt64() {
		return 0, false
	}
	return v.Int64(), true
}

// chunk is the part of a window one item carries.
type chunk struct {
	ids   []int64
	value int64
	at    time.Time // the latest occurred_at of its rows
}

// sqlSplitRows reads a window's rows, of one tenant's bucket, in the order
// of their ids given.
const sqlSplitRows = `SELECT u.id, u.value, u.occurred_at FROM usage_events u
		JOIN unnest($1::bigint[]) WITH ORDINALITY AS w(id, n) ON u.id = w.id WHERE u.bucket = $2 ORDER BY w.n`

// splitWindow splits a window's rows (ids, in time order, of a tenant of
// bucket) into chunks whose sums stay within ±limit (at most a signed
// 64-bit integer's range): a new chunk starts when the next value would
// take the running sum out of range.
// A value out of range on its own makes a chunk of its own, which the
// stager quarantines (value_digits); every chunk holds at least one row.
func splitWindow(ctx context.Context, tx pgx.Tx, bucket int16, ids []int64, limit int64) ([]chunk, error) {
	rows, err := tx.Query(ctx, sqlSplitRows, ids, bucket)
	if err != nil {
		return nil, fmt.Errorf("reading the window's rows: %w", err)
	}
	var (
		out []chunk
		cur chunk
		id  int64
		v   int64
		at  time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &v, &at}, func() error {
		if len(cur.ids) > 0 && !sumFits(cur.value, v, limit) {
			out = append(out, cur)
			cur = chunk{}
		}
		cur.ids, cur.value, cur.at = append(cur.ids, id), cur.value+v, at
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading the window's rows: %w", err)
	}
	return append(out, cur), nil
}

// sumFits reports whether cur and cur+v are both within ±limit (limit ≤
// math.MaxInt64), without overflowing.
func sumFits(cur, v, limit int64) bool {
	if cur < -limit || cur > limit {
		return false
	}
	if (v > 0 && cur > limit-v) || (v < 0 && cur < -limit-v) {
		return false
	}
	return true
}
