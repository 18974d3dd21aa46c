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
//     0.7–2.6 million and spent 1.5–1.8 s compiling (inlining, optimisation,
//     emission of 140 functions) to run 12 ms of work: 111× the empty
//     database (docs/performance.md, "Measured once analysed"). A routine statement never
//     runs long enough to pay a compilation back.
//   - max_parallel_workers_per_gather=0, for the same estimates: beside 20
//     million ledger rows the analysed statistics put the current month
//     at 77,933 events where there were 1,070, and the completeness
//     report's scan of them became a parallel one. Starting the workers
//     took 45 ms of a 75 ms report whose workers then spent 4 ms each:
//     5.4× the empty database (the same section). Tally's statements
//     read a month, a batch or an hour; on the two cores it is sized for,
//     a worker takes a core from the deliverers besides.
func Defaults(params map[string]string) {
	for k, v := range map[string]string{"jit": "off", "max_parallel_workers_per_gather": "0"} {
		if _, ok := params[k]; !ok {
			params[k] = v
		}
	}
}
