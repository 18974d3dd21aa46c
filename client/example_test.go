package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/tallymeter/tally/client"
)

// A product service posts each request's usage as it happens, through the
// buffer, and closes the client on its way out so that the last batch is
// delivered.
func Example() {
	c, err := client.New("https://tally.internal", os.Getenv("TALLY_INGEST_TOKEN"),
		client.WithBatchSize(500), client.WithFlushInterval(2*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.Close(ctx); err != nil {
			log.Printf("usage not delivered: %v", err) // the events are in the error: keep them, post them again
		}
	}()

	// In a request handler: the id is the request's own, so that a
	// request served twice is billed once.
	ctx := context.Background()
	if err := c.Add(ctx, client.Event{ID: "req-8812", Tenant: "acme", Feature: "api_calls", Value: 3}); err != nil {
		log.Printf("usage not buffered: %v", err)
	}
}

// Post sends events now and answers once Tally stored them; a 422 names
// the events and fields at fault.
func ExampleClient_Post() {
	c, err := client.New("https://tally.internal", os.Getenv("TALLY_INGEST_TOKEN"))
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	res, err := c.Post(ctx,
		client.Event{ID: "job-77-cpu", Tenant: "acme", Feature: "cpu_seconds", Value: 5400, Timestamp: at},
		client.Event{ID: "job-77-gpu", Tenant: "acme", Feature: "gpu_seconds", Value: 600, Timestamp: at},
	)
	var invalid *client.InvalidError
	switch {
	case errors.As(err, &invalid):
		for _, p := range invalid.Problems {
			log.Printf("refused: %s", p) // e.g. "event 1 feature: 1 to 64 characters: …"
		}
	case err != nil:
		log.Printf("not delivered, post again later (ids deduplicate): %v", err)
	default:
		log.Printf("%d stored, %d were stored before", res.Accepted, res.Duplicates)
	}
}

// Flush delivers what was added so far — at the end of a job, say — and
// lists what could not be delivered, with why.
func ExampleClient_Flush() {
	c, err := client.New("https://tally.internal", os.Getenv("TALLY_INGEST_TOKEN"))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	for i := range 100 {
		ev := client.Event{ID: fmt.Sprintf("batch-42-row-%d", i), Tenant: "acme", Feature: "rows_processed", Value: 1}
		if err := c.Add(ctx, ev); err != nil {
			log.Fatal(err)
		}
	}
	var undelivered *client.UndeliveredError
	if err := c.Flush(ctx); errors.As(err, &undelivered) {
		for _, u := range undelivered.Events {
			log.Printf("event %s not delivered: %v", u.Event.ID, u.Err)
		}
	}
}

// An error handler sees, as they happen, the buffered events that were not
// delivered — to keep them somewhere durable rather than lose them.
func ExampleWithErrorHandler() {
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	keep := func(u *client.UndeliveredError) {
		for _, e := range u.Events {
			// A real service would write e.Event to its own outbox or a
			// dead-letter file; the event carries the timestamp Add gave
			// it, so posting it again later is a duplicate, never a
			// conflict, if it was stored after all.
			logger.Error("usage not delivered", "id", e.Event.ID, "cause", e.Err)
		}
	}
	c, err := client.New("https://tally.internal", os.Getenv("TALLY_INGEST_TOKEN"),
		client.WithErrorHandler(keep), client.WithLogger(logger), client.WithRetryBudget(5*time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	_ = c
}
