// Package meter owns the usage ledger and its windows: every accepted usage
// event as an immutable ledger row, and the stager that folds unstaged rows
// into windows and hands each window to the outbox (T0, or T0q when it is
// ineligible) in the same transaction that marks the rows with their item,
// so that every ledger row ends in exactly one item.
//
// It must never change an outbox item's state other than by outbox.Enqueue,
// never delete or update a ledger row's content, and never drop usage: what
// it cannot export it stages quarantined. Its code arrives with issue 3; this
// file states the package's contract.
package meter
