// Package commentcheck holds a test that keeps the comments of Tally's
// non-test Go code free of lab notes: issue and migration numbers, section
// signs, outbox transition numbers, which test caught what, and measurement
// reports belong in commit messages and docs, not beside the code. It has
// no code of its own and must never be imported.
package commentcheck
