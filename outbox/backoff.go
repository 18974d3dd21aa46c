package outbox

import (
	"math/rand/v2"
	"time"
)

// Backoff returns the un-jittered retry delay after the given attempt
// (1-based: the delay after the first attempt is base):
//
//	min(cap, base * 2^(attempts-1))
func Backoff(attempts int, base, cap time.Duration) time.Duration {
	if attempts < 1 {
		attempts = 1
	}
	d := base
	for i := 1; i < attempts; i++ {
		if d >= cap/2 {
			return cap
		}
		d *= 2
	}
	return min(d, cap)
}

// Jitter returns d plus a uniformly random extra of up to a quarter of d, so
// that items which failed together do not retry in the same second.
func Jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return d + time.Duration(rand.Int64N(int64(d/4)+1))
}
