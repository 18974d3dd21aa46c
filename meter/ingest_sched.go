package meter

import (
	"context"
	"sync"
	"time"

	"github.com/tallymeter/tally/internal/pgdb"
)

// groupCommitter is an Ingester's open group, its commit slots, and what it
// learnt of the groups written so far.
type groupCommitter struct {
	once  sync.Once
	slots chan struct{} // a token for each group being written; made once

	mu     sync.Mutex
	open   *group // the group new batches join; nil when none; guarded by mu
	recent recent // of the groups written; guarded by mu
}

// group is batches that share one transaction.
type group struct {
	reqs          []*pending // written under groupCommitter.mu until the group closes
	events, bytes int        // totals of reqs, under groupCommitter.mu
	full          chan struct{}
	closed        bool          // full was closed; under groupCommitter.mu
	target        int           // batches awaitPeers waits for; under groupCommitter.mu
	enough        chan struct{} // closed (and set nil) by join at target; under groupCommitter.mu
	done          chan struct{} // closed when every pending has its answer
}

// recent is what the groupCommitter learnt of the groups it wrote, each average
// moving by a share of recentWeight a group: how many batches the group of
// a typical batch holds (the mean of group sizes weighted by their
// batches, so that the groups of one that slip between large ones do not
// hide how many clients post together), and how long writing a group
// takes.
type recent struct {
	sizes, squares float64       // decaying sums of each group's batches and their squares
	write          time.Duration // moving average of writeGroup's time
}

// recentWeight is the weight of the newest group in recent's averages.
const recentWeight = 1.0 / 8

// observe adds a group of n batches written in took.
func (r *recent) observe(n int, took time.Duration) {
	f := float64(n)
	r.sizes = r.sizes*(1-recentWeight) + f
	r.squares = r.squares*(1-recentWeight) + f*f
	if r.write == 0 {
		r.write = took
	} else {
		r.write += time.Duration(recentWeight * float64(took-r.write))
	}
}

// typical is the size of the group a typical batch was written in; 0
// before any.
func (r *recent) typical() float64 {
	if r.sizes == 0 {
		return 0
	}
	return r.squares / r.sizes
}

// join adds p to the open group, opening one when there is none; leader
// says p opened it and so writes it.
func (in *Ingester) join(p *pending) (g *group, leader bool) {
	b := &in.committer
	b.once.Do(func() { b.slots = make(chan struct{}, max(1, in.GroupCommit.Commits)) })
	b.mu.Lock()
	defer b.mu.Unlock()
	size := 0
	for _, ev := range p.events {
		size += len(ev.ID) + len(ev.Tenant) + len(ev.Feature) + eventOverhead
	}
	c := in.GroupCommit
	if g := b.open; g != nil && (g.events+len(p.events) > c.MaxEvents || (c.MaxBytes > 0 && g.bytes+size > c.MaxBytes)) {
		b.closeOpen() // p does not fit: its own group follows
	}
	if b.open == nil {
		b.open = &group{full: make(chan struct{}), done: make(chan struct{})}
		leader = true
	}
	g = b.open
	g.reqs = append(g.reqs, p)
	g.events += len(p.events)
	g.bytes += size
	if g.enough != nil && len(g.reqs) >= g.target {
		close(g.enough)
		g.enough = nil
	}
	if g.events >= c.MaxEvents || (c.MaxBytes > 0 && g.bytes >= c.MaxBytes) {
		b.closeOpen()
	}
	return g, leader
}

// lead waits for a commit slot, then for peers (awaitPeers), and writes
// the group. The transaction does not end with the leader's request: a
// client that goes away must not fail the others.
func (in *Ingester) lead(ctx context.Context, db pgdb.DB, g *group) {
	b := &in.committer
	select {
	case b.slots <- struct{}{}:
	case <-g.full:
		b.slots <- struct{}{}
	}
	defer func() { <-b.slots }()
	defer func() {
		if v := recover(); v != nil {
			// The others must not wait for ever, nor be told their batch was
			// stored: an error is safe (a retry deduplicates), 202 is not.
			for _, p := range g.reqs {
				p.res, p.err = Result{}, errGroupPanicked
			}
			close(g.done)
			panic(v)
		}
	}()
	in.awaitPeers(g)
	b.mu.Lock()
	if !g.closed {
		b.closeOpen()
	}
	b.mu.Unlock()
	start := time.Now()
	in.writeGroup(context.WithoutCancel(ctx), db, g.reqs)
	took := time.Since(start)
	b.mu.Lock()
	b.recent.observe(len(g.reqs), took)
	b.mu.Unlock()
	close(g.done)
}

// awaitPeers waits, once the group has a commit slot, for the peers
// peerWait names, or for the group to fill.
func (in *Ingester) awaitPeers(g *group) {
	b := &in.committer
	b.mu.Lock()
	target, wait := b.recent.peerWait(in.GroupCommit.Wait)
	if wait <= 0 || g.closed || len(g.reqs) >= target {
		b.mu.Unlock()
		return
	}
	g.target, g.enough = target, make(chan struct{})
	enough := g.enough
	b.mu.Unlock()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-enough:
	case <-g.full:
	}
}

// peerWait is how many batches a group that has a commit slot waits for,
// and at most how long: as many as the group of a typical batch recently
// held (recent.typical), for no longer than limit nor than writing a
// group recently took.
//
// Clients that post again as soon as they are answered come back
// together, just after their group committed. Without the wait, the first
// of them back takes the slot its group left and is written alone while
// the others are still on their way, and one slot ends up carrying groups
// of one. With it, those clients share the slot again, and the groups stay
// as large as the clients posting together. A lone client never waits
// (its group holds the one batch typical of it), nor does the first group
// (nothing written yet), and a batch waits at most limit beyond its wait
// for a slot and its own commit. Where requests come independently of
// their answers, a group may wait out its bound each time: at most a
// recent write's time.
func (r *recent) peerWait(limit time.Duration) (target int, wait time.Duration) {
	return int(r.typical()), min(limit, r.write)
}

// closeOpen closes the open group to new batches; b.mu is held.
func (b *groupCommitter) closeOpen() {
	g := b.open
	b.open, g.closed = nil, true
	close(g.full)
}
