package meter

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/mappings"
)

// owned is an event of a group with the batch it belongs to.
type owned struct {
	req *pending
	i   int // index into req.events
}

// ingestGroup does, in the caller's transaction, what follows the insert
// of a group's events (firsts, in the order inserted; inserted the rows
// written; maps the mappings of their tenants and features, read in the
// transaction): one staging for all of the group's batches, and gives each batch its own Result, as if each had
// been ingested alone, one after the other:
//
//   - An event whose (tenant, id) an earlier batch of the group posts too,
//     with the same content, is that batch's duplicate. With other content,
//     the later batch is deferred (mergeGroup): it leaves the group and,
//     once the group committed, is ingested alone, where it finds the
//     earlier batch's event stored (and is refused) — or, if the earlier
//     batch was refused, not (and is stored).
//   - A batch with an event stored before with other content (an
//     *InvalidBatchError) or whose new events would make more quarantined
//     items than Ingester.MaxQuarantined (a *QuarantineCapError, counted
//     over that batch's events alone) is refused on its own: ingestGroup
//     sets its err and returns how many it refused; the caller then rolls
//     the transaction back and writes the group again without them. Each
//     attempt refuses at least one batch or succeeds, so a group of n
//     batches is written at most n+1 times.
//
// Any other error is the group's: every batch of it fails with it.
func (in *Ingester) ingestGroup(ctx context.Context, tx pgx.Tx, firsts []owned, inserted map[eventKey]insertedRow, maps map[[2]string]mappings.Pair) (refused int, err error) {
	all := make([]Event, len(firsts)) // the group's events, for the mappings and staging
	allUnique := make([]int, len(firsts))
	for j, o := range firsts {
		all[j], allUnique[j] = o.req.events[o.i], j
	}
	if len(inserted) < len(firsts) {
		if err := in.compareExisting(ctx, tx, all, allUnique, inserted, &Result{}); err != nil {
			if refused, err = refuseChanged(err, firsts); err != nil || refused > 0 {
				return refused, err
			}
		}
	}
	mine := map[*pending][]int{} // each batch's own new events
	for _, o := range firsts {
		ev := o.req.events[o.i]
		if _, ok := inserted[eventKey{ev.Tenant, ev.ID}]; !ok {
			o.req.res.Duplicates++
			continue
		}
		o.req.res.Accepted++
		mine[o.req] = append(mine[o.req], o.i)
		if p := maps[[2]string{ev.Tenant, ev.Feature}]; p.Feature == nil || p.Tenant == nil {
			o.req.res.Unmapped++
		}
	}
	if in.MaxQuarantined > 0 {
		for p, idx := range mine {
			if len(idx) <= in.MaxQuarantined {
				continue // at most one item per new event
			}
			if err := in.capQuarantine(ctx, tx, p.events, idx, inserted, maps); err != nil {
				p.err, refused = err, refused+1
			}
		}
		if refused > 0 {
			return refused, nil
		}
	}
	if in.Stager != nil {
		err = in.Stager.stageNewEvents(ctx, tx, all, allUnique, inserted, maps)
	}
	return 0, err
}

// mergeGroup lists the events of the group first with their (tenant, id),
// each with its batch; an event repeating one of an earlier batch with the
// same content counts as that batch's duplicate, with other content it
// defers its batch (see ingestGroup).
func mergeGroup(reqs []*pending) (firsts []owned, live, deferred []*pending) {
	first := map[eventKey]owned{}
	for _, p := range reqs {
		var mine []owned
		clash := false
		for _, i := range p.unique {
			ev := p.events[i]
			o, seen := first[eventKey{ev.Tenant, ev.ID}]
			switch {
			case !seen:
				mine = append(mine, owned{p, i})
			case sameContent(o.req.events[o.i], ev):
				// counted as a duplicate below, with the batch's own
			default:
				clash = true
			}
		}
		if clash {
			deferred = append(deferred, p)
			continue
		}
		p.dups = len(p.events) - len(mine) // the batch's repeats, within it and of the group
		for _, o := range mine {
			first[eventKey{o.req.events[o.i].Tenant, o.req.events[o.i].ID}] = o
		}
		firsts = append(firsts, mine...)
		live = append(live, p)
	}
	return firsts, live, deferred
}

// refuseChanged gives each batch the problems compareExisting found among
// its events (indexed into firsts), as its own *InvalidBatchError with its
// own indexes, and counts the batches refused; another error is the
// group's.
func refuseChanged(err error, firsts []owned) (int, error) {
	invalid, ok := err.(*InvalidBatchError)
	if !ok {
		return 0, err
	}
	byReq := map[*pending][]Problem{}
	for _, pr := range invalid.Problems {
		if pr.Index == nil || *pr.Index >= len(firsts) {
			return 0, err
		}
		o := firsts[*pr.Index]
		idx := o.i
		pr.Index = &idx
		byReq[o.req] = append(byReq[o.req], pr)
	}
	for p, problems := range byReq {
		slices.SortFunc(problems, func(a, b Problem) int { return cmp.Compare(*a.Index, *b.Index) })
		p.err = &InvalidBatchError{Problems: problems}
	}
	return len(byReq), nil
}
