// Package reconcile owns the comparison of what Tally holds as accepted or
// confirmed with Stripe's own numbers (hourly meter event summaries), the
// runs that do it and the discrepancies finance acts on, and the
// confirmation (confirm) of items the evidence proves.
//
// A run works through every (account, customer, meter) with accepted items
// older than the settle delay or uncertain ones, and every one with a
// billing period still open (not past its end plus the invoice grace, by
// the database's clock), one key at a time: it reads the key's hourly
// summaries (through its own class of the account's budget, so that its
// 429s never slow export), compares each hour by the meter's formula —
// every hour of an open period, confirmed or not, and one where Stripe has
// a number and Tally no item — and commits the hour's confirmations, its
// discrepancies, the older discrepancies of the hours it compared (cleared),
// the key's open periods and the run's progress in one transaction per
// key, so that a run killed mid-way resumes after its last key, and a
// rerun ends where an uninterrupted run would have. A key whose summaries
// Stripe refuses with a 4xx about that key (a customer or meter it does
// not know) is recorded as one discrepancy of its own and the run goes on.
//
// A discrepancy has a kind (Stripe has more — a customer may be billed too
// much —, Stripe has less, summaries refused), and every list shows Stripe
// having more first. It is open until finance resolves it or a later run
// compares its hour again. Finance resolves a discrepancy (Resolve) with a
// reason from a fixed set that fits its kind and a note: the
// discrepancy's items still accepted are confirmed (through package
// outbox), and the resolution and its audit entry recorded, in one
// transaction. A resolution covers the same numbers of the same hour of
// the key in every run: a later run does not record them again.
//
// It also records Stripe's events (Events), however they arrive: posted by
// the event destination, or read by the hourly listing of every exported
// account's events (Backfill, a River job). An event about an account
// Tally exports to is read in its context and recorded once; one about
// another account is recorded as foreign, one Stripe refuses to let Tally
// read as unreadable (the listing reads it again). A meter error report
// (RecordReport) records evidence, moves the accepted items it names, and
// a note on the items still in flight that their next accept honours.
//
// Operators recover uncertain items (Recover; RecoverAll, several in one
// transaction, all or none), each with its audit entry; a run's plan
// (PlanOf) lists the recoveries its evidence supports. ListOpen pages the
// open discrepancies of every run, newest first.
//
// It must never confirm on a mismatch finance has not resolved, never move an item other than
// through package outbox, never resend anything, and never compare an hour
// that still has an item pending or in flight.
package reconcile
