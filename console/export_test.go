package console

import "time"

// SetSignInThrottle gives c a sign-in throttle of these limits, on the
// clock now: tests reach the global ceiling and the refill without
// hundreds of requests or minutes of waiting.
func SetSignInThrottle(c *Console, failures int, every time.Duration, global int, globalEvery time.Duration, now func() time.Time) {
	c.throttle = newSignInThrottle(signInLimits{Failures: failures, Every: every, GlobalFailures: global, GlobalEvery: globalEvery,
		Addresses: defaultSignInAddresses})
	c.throttle.now = now
}

// SettleWords is settleWords, for its table test.
var SettleWords = settleWords
