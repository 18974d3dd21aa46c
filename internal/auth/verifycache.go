package auth

import (
	"context"
	"crypto/sha256"
	"slices"
	"sync"
	"time"
)

// VerifiedTTL is how long a VerifiedCache answers a verified token without
// asking the database: revoking a token, or its expiry, takes effect on a
// node within this long.
const VerifiedTTL = 2 * time.Second

// maxVerified bounds the tokens a VerifiedCache keeps; when full it
// forgets them all (the next request of each asks the database again).
const maxVerified = 10_000

// VerifiedCache answers Verify from memory for a token verified within
// VerifiedTTL, so that a node serving many small requests asks the
// database once a token every VerifiedTTL rather than once a request. It
// keeps the SHA-256 of a token, never the token; an unknown token is never
// remembered (a token created a moment ago works at once), and neither is
// an error. The zero value is ready to use; it must not be copied.
type VerifiedCache struct {
	now func() time.Time // time.Now unless a test sets it

	mu     sync.Mutex
	byHash map[[sha256.Size]byte]verified // guarded by mu
}

type verified struct {
	p     Principal
	until time.Time
}

// Verify is Verify(ctx, q, presented), answered from the cache when the
// token was verified less than VerifiedTTL ago.
func (c *VerifiedCache) Verify(ctx context.Context, q Querier, presented string) (Principal, error) {
	if presented == "" || len(presented) > 512 {
		return Principal{}, ErrUnknownToken
	}
	now := time.Now
	if c.now != nil {
		now = c.now
	}
	hash := sha256.Sum256([]byte(presented))
	c.mu.Lock()
	v, ok := c.byHash[hash]
	c.mu.Unlock()
	if ok && now().Before(v.until) {
		return v.p, nil
	}
	p, err := Verify(ctx, q, presented)
	if err != nil {
		return p, err
	}
	p.Tenants = slices.Clip(p.Tenants) // shared by the requests it answers: appending must copy
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byHash == nil || len(c.byHash) >= maxVerified {
		c.byHash = map[[sha256.Size]byte]verified{}
	}
	c.byHash[hash] = verified{p: p, until: now().Add(VerifiedTTL)}
	return p, nil
}
