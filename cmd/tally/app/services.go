package app

import (
	"context"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
)

// service is one part of a running node. Every part has this one shape
// (River's startstop, in spirit), so that one function starts them in order
// and stops them in reverse:
//
//   - Start begins the service's work and returns once it runs, or says why
//     it could not start. The work ends when the ctx given to Start ends.
//   - Stop waits until the work has ended, bounded by its ctx where the
//     service can bound it, and says why it did not end cleanly.
type service interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context) error
}

// services runs a node's services: it starts them in order on one context
// and stops the started ones in reverse. The picture:
//
//	start:  s1 → s2 → … → sn     (one fails: abort, in reverse from its predecessor)
//	run:    until the context ends, a service halts the node, or the caller aborts
//	stop:   cancel, then sn → … → s2 → s1
type services struct {
	// cancel ends the context the services run on.
	cancel context.CancelFunc
	// started are the services whose Start succeeded, in order.
	started []service

	mu sync.Mutex
	// halted is why a service ended the node (halt), or nil.
	halted error
}

// newServices returns the runner of services started on a context that
// cancel ends.
func newServices(cancel context.CancelFunc) *services {
	return &services{cancel: cancel}
}

// start starts list in order on ctx. If one cannot start, the started ones
// are stopped (abort) and its error is returned.
func (s *services) start(ctx context.Context, list ...service) error {
	for _, svc := range list {
		if err := svc.Start(ctx); err != nil {
			s.abort(ctx, nil)
			return err
		}
		s.started = append(s.started, svc)
	}
	return nil
}

// halt ends the node because of err, from a service that runs: the
// services' context ends, the caller stops them as on a signal, and stop
// returns err. The first halt's error is kept.
func (s *services) halt(err error) {
	s.mu.Lock()
	if s.halted == nil {
		s.halted = err
	}
	s.mu.Unlock()
	s.cancel()
}

// stop is the graceful end: it ends the services' context, stops the
// started services in reverse, each bounded by ctx, and returns why the node
// ended — the error it was halted with, else the first error of a Stop,
// else nil.
func (s *services) stop(ctx context.Context) error {
	s.cancel()
	var err error
	for i := len(s.started) - 1; i >= 0; i-- {
		if serr := s.started[i].Stop(ctx); serr != nil && err == nil {
			err = serr
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.halted != nil {
		return s.halted
	}
	if err != nil {
		return fmt.Errorf("shutting down: %w", err)
	}
	return nil
}

// abort is the end after a failure: it ends the services' context and stops
// the started services in reverse, without a time bound (ctx's values only)
// and ignoring their errors — except failed, which no longer runs.
func (s *services) abort(ctx context.Context, failed service) {
	s.cancel()
	ctx = context.WithoutCancel(ctx)
	for i := len(s.started) - 1; i >= 0; i-- {
		if s.started[i] != failed {
			_ = s.started[i].Stop(ctx)
		}
	}
}

// loop is a service that is one goroutine: run works until its context
// ends. Stop waits for run to return, whatever Stop's ctx says: a deliverer,
// say, records the outcomes of its sends in flight first, each send bounded
// by its own timeouts.
type loop struct {
	run  func(ctx context.Context)
	done chan struct{}
}

func newLoop(run func(ctx context.Context)) *loop { return &loop{run: run} }

func (l *loop) Start(ctx context.Context) error {
	l.done = make(chan struct{})
	go func() {
		defer close(l.done)
		l.run(ctx)
	}()
	return nil
}

func (l *loop) Stop(context.Context) error {
	<-l.done
	return nil
}

// riverService is the River client: the periodic staging and reconcile jobs
// and their workers. Stop lets the jobs running finish, bounded by ctx.
type riverService struct {
	client *river.Client[pgx.Tx]
}

func (r riverService) Start(ctx context.Context) error {
	if err := r.client.Start(ctx); err != nil {
		return fmt.Errorf("starting River: %w", err)
	}
	return nil
}

func (r riverService) Stop(ctx context.Context) error { return r.client.Stop(ctx) }
