package auth

import "time"

// SetNow sets the clock a VerifiedCache reads for its entries' age.
func (c *VerifiedCache) SetNow(now func() time.Time) { c.now = now }
