package stripesim

import (
	"sync"
	"time"
)

// MovedClock is a clock for [Options.Now] that runs with the real time
// from an offset a test moves forward or back: Stripe's clock, hours or
// days from the node's. It is safe for concurrent use.
type MovedClock struct {
	mu  sync.Mutex
	off time.Duration
}

// Now is the real time plus the offset.
func (c *MovedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

// Add moves the clock by d.
func (c *MovedClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.off += d
}
