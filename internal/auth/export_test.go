package auth

import "time"

// SetNow sets the clock a VerifiedCache reads for its entries' age.
func (c *VerifiedCache) SetNow(now func() time.Time) { c.now = now }

// UnknownLen is how many unknown tokens c remembers.
func (c *VerifiedCache) UnknownLen() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.unknown)
}
