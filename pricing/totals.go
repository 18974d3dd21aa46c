package pricing

import (
	"math/big"
	"slices"
)

// Sum is the total of the quotes of one currency.
type Sum struct {
	Currency string
	// Lines is the number of quotes added.
	Lines int
	// Amount is the sum of the lines' Amounts: Stripe rounds each line
	// before it sums an invoice, so the total is not Exact rounded.
	Amount int64
	// MinAmount and MaxAmount are the sums of the lines' bounds.
	MinAmount, MaxAmount int64
	// Exact is the sum of the lines' exact amounts.
	Exact *big.Rat
}

// Totals sums quotes per currency; amounts of two currencies are never
// added. The zero value is ready to use; a Totals is not safe for
// concurrent use.
type Totals struct {
	sums map[string]*Sum
}

// Add adds q to its currency's sum. It refuses a quote without a currency,
// and a sum that would not fit in int64 minor units (leaving the sum as it
// was).
func (t *Totals) Add(q Quote) error {
	cur, err := normalCurrency(q.Currency)
	if err != nil {
		return err
	}
	s := t.sums[cur]
	if s == nil {
		s = &Sum{Currency: cur, Exact: new(big.Rat)}
	}
	amount, ok1 := addInt64(s.Amount, q.Amount)
	lo, ok2 := addInt64(s.MinAmount, q.MinAmount)
	hi, ok3 := addInt64(s.MaxAmount, q.MaxAmount)
	if !ok1 || !ok2 || !ok3 {
		return notModeled(CodeOverflow, "the "+cur+" total does not fit in int64 minor units")
	}
	if t.sums == nil {
		t.sums = map[string]*Sum{}
	}
	s.Lines++
	s.Amount, s.MinAmount, s.MaxAmount = amount, lo, hi
	if q.Exact != nil {
		s.Exact.Add(s.Exact, q.Exact)
	} else {
		s.Exact.Add(s.Exact, new(big.Rat).SetInt64(q.Amount))
	}
	t.sums[cur] = s
	return nil
}

// Currencies lists the currencies added, sorted.
func (t *Totals) Currencies() []string {
	out := make([]string, 0, len(t.sums))
	for c := range t.sums {
		out = append(out, c)
	}
	slices.Sort(out)
	return out
}

// Sum returns a copy of currency's sum, and whether any quote of it was added.
func (t *Totals) Sum(currency string) (Sum, bool) {
	cur, err := normalCurrency(currency)
	if err != nil {
		return Sum{}, false
	}
	s := t.sums[cur]
	if s == nil {
		return Sum{}, false
	}
	out := *s
	out.Exact = new(big.Rat).Set(s.Exact)
	return out, true
}

func addInt64(a, b int64) (int64, bool) {
	c := a + b
	if (c > a) != (b > 0) {
		return 0, false
	}
	return c, true
}
