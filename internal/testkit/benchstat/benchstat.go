// Package benchstat holds the little statistics the benchmarks print: the
// median of repeated runs, which a loaded 2-core machine disturbs less than
// a mean. It owns no measurement and must never be imported by product
// code.
package benchstat

import (
	"cmp"
	"slices"
)

// Median is the middle of xs once sorted (the upper of the two middles
// when their number is even); xs is left as it was. It panics on an empty
// slice.
func Median[T cmp.Ordered](xs []T) T {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
