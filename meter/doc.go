// Package meter owns the usage ledger and its staging. Ingest validates a
// batch of usage events and writes it to the immutable ledger in one
// transaction (a duplicate is counted, a changed duplicate refused); events
// of per-event (count) features are staged in that same transaction. The
// stager folds the other usage into windows — grid-aligned UTC, cut at
// billing-period boundaries, closed once their end plus a grace has passed —
// and hands each window to the outbox (stage; stage_quarantined if ineligible) in
// the same transaction that marks its rows with the item, so every ledger row
// ends in exactly one item. Late rows for a staged window become a
// supplement ("#n").
//
// Group commit lives here, in Ingester.Post, not in api: what a batch
// shares with others of its group (one insert, one read of the mappings,
// one staging, one commit) and what it keeps of its own (its duplicates,
// its 422 problems, its quarantine cap, a refusal that takes it alone out
// of the group) are decisions about the ledger; api still decodes,
// authorises and applies a token's quotas per request before the batch
// joins, and answers once Post returns, after the commit. A batch is never
// answered before the transaction holding it committed, and one
// transaction holds the whole of it or none.
//
// The ledger is partitioned by month of occurred_at; every event id has a
// key (usage_event_keys) kept for good, so that an id is stored once across
// months. DetachMonth takes a month out of the database, as the owner role,
// only with the verified archives of the periods it holds; the month is
// then closed and its events are refused period_closed.
//
// It never deletes or rewrites a ledger row (a month leaves whole, by
// DetachMonth, once archived), never drops usage (what it cannot export it
// stages quarantined, with the reason), and never changes an item's state
// other than by outbox.Enqueue.
package meter
