package meter

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5"
)

// owned is an event of a group with the batch it belongs to.
type owned struct {
	req *pending
	i   int // index into req.events
}

// ingestGroup writes the batches of a group in the caller's transaction,
// with one insert, one read of the mappings and one staging for all of
// them, and gives each batch its own Result, as if each had been ingested
// alone, one after the other:
//
//   - An event whose (tenant, id) an earlier batch of the group posts too,
//     with the same content, is that batch's duplicate. With other content,
//     the later batch is deferred: it leaves the group and, once the group
//     committed, is ingested alone, where it finds the earlier batch's
//     event stored (and is refused) — or, if the earlier batch was refused,
//     not (and is stored).
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
func (in *Ingester) ingestGroup(ctx context.Context, tx pgx.Tx, reqs []*pending) (refused int, deferred []*pending, err error) {
	firsts, live, deferred := mergeGroup(reqs)
	if len(firsts) == 0 {
		for _, p := range live {
			p.res = Result{Duplicates: p.dups}
		}
		return 0, deferred, nil
	}
	// Insert in (tenant, id) order, as Ingest does, so that two groups
	// posting overlapping ids wait for each other instead of deadlocking.
	slices.SortFunc(firsts, func(a, b owned) int {
		ea, eb := a.req.events[a.i], b.req.events[b.i]
		return cmp.Or(cmp.Compare(ea.Tenant, eb.Tenant), cmp.Compare(ea.ID, eb.ID))
	})
	inserted, err := in.insertOwned(ctx, tx, firsts)
	if err != nil {
		return 0, deferred, err
	}
	var all []Event // the group's events, for the mappings and staging
	var allUnique []int
	for _, o := range firsts {
		allUnique = append(allUnique, len(all))
		all = append(all, o.req.events[o.i])
	}
	if len(inserted) < len(firsts) {
		if err := in.compareExisting(ctx, tx, all, allUnique, inserted, &Result{}); err != nil {
			if refused, err = refuseChanged(err, firsts); err != nil || refused > 0 {
				return refused, deferred, err
			}
		}
	}
	maps, err := newEventMappings(ctx, tx, all, allUnique, inserted)
	if err != nil {
		return 0, deferred, err
	}
	for _, p := range live {
		p.res = Result{Duplicates: p.dups}
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
			return refused, deferred, nil
		}
	}
	if in.Stager != nil {
		err = in.Stager.stageNewEvents(ctx, tx, all, allUnique, inserted, maps)
	}
	return 0, deferred, err
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

// insertOwned inserts the group's events in their order (insertEvents).
func (in *Ingester) insertOwned(ctx context.Context, tx pgx.Tx, firsts []owned) (map[eventKey]insertedRow, error) {
	evs := make([]Event, len(firsts))
	for j, o := range firsts {
		evs[j] = o.req.events[o.i]
	}
	return in.insertEvents(ctx, tx, evs)
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
