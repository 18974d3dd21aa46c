// Package pgsession owns the session settings every Postgres connection
// Tally opens starts with, whatever the server's own defaults: serve's
// workload pools, the commands' pool, a diagnosis's, and the tests' and
// benchmarks' pools, so that what is measured is what runs.
//
// It is a leaf. It must never override a setting the database URL names
// (the operator's word wins), and never hold a workload's own bounds
// (statement_timeout and the like are cmd/tally/app's, per pool).
package pgsession

// Defaults sets, in params (a pgconn.Config's RuntimeParams, which the
// URL's settings are already in), the settings Tally's statements are
// planned for, each unless the URL set it:
//
//   - jit=off. Every statement Tally runs is built to read little: a claim
//     batch, a report of one month. Postgres's JIT compiles a statement
//     whose estimated cost passes jit_above_cost (100,000 by default) —
//     and a statement over a table with a long history gets such
//     estimates. Once ANALYZE had seen the current month, the
//     completeness report beside 2 million ledger rows was estimated at
//     2.6 million and spent 1.5–1.8 s compiling (inlining, optimisation,
//     emission of 140 functions) to run 12 ms of work: 111× the empty
//     database (docs/performance.md, "JIT"). A routine statement never
//     runs long enough to pay a compilation back.
func Defaults(params map[string]string) {
	if _, ok := params["jit"]; !ok {
		params["jit"] = "off"
	}
}
