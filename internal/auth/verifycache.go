package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/tallymeter/tally/internal/pgdb"
)

// VerifiedTTL is how long a VerifiedCache answers a verified token without
// asking the database: revoking a token, or its expiry, takes effect on a
// node within this long.
const VerifiedTTL = 2 * time.Second

// maxVerified bounds the tokens a VerifiedCache keeps; when full it
// forgets them all (the next request of each asks the database again).
const maxVerified = 10_000

// UnknownTTL is how long a VerifiedCache refuses an unknown token without
// asking the database again: a value refused before it became a token (a
// configured one, seeded by another node) works within this long. A
// generated token cannot have been presented before it was made.
const UnknownTTL = 2 * time.Second

// MaxUnknown bounds the unknown tokens a VerifiedCache remembers; when full,
// an arbitrary one is forgotten for each new one, so that a flood of
// distinct random tokens costs a query each but no more memory, and never
// evicts a verified token.
const MaxUnknown = 10_000

// VerifiedCache answers Verify from memory for a token verified within
// VerifiedTTL, so that a node serving many small requests asks the
// database once a token every VerifiedTTL rather than once a request. It
// keeps the SHA-256 of a token, never the token. An unknown token is
// refused from memory for UnknownTTL, so that a client repeating a wrong
// token costs a query every UnknownTTL, not every request; an error is
// never remembered. The zero value is ready to use; it must not be copied.
type VerifiedCache struct {
	now func() time.Time // time.Now unless a test sets it

	mu      sync.Mutex
	byHash  map[[sha256.Size]byte]verified  // guarded by mu
	unknown map[[sha256.Size]byte]time.Time // guarded by mu: hash → refused until
}

type verified struct {
	p     Principal
	until time.Time
}

// Verify is Verify(ctx, q, presented), answered from the cache when the
// token was verified less than VerifiedTTL ago.
func (c *VerifiedCache) Verify(ctx context.Context, q pgdb.Querier, presented string) (Principal, error) {
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
	refusedUntil, refused := c.unknown[hash]
	c.mu.Unlock()
	if ok && now().Before(v.until) {
		return v.p, nil
	}
	if refused && now().Before(refusedUntil) {
		return Principal{}, ErrUnknownToken
	}
	p, err := Verify(ctx, q, presented)
	if errors.Is(err, ErrUnknownToken) {
		c.rememberUnknown(hash, now().Add(UnknownTTL))
	}
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
	delete(c.unknown, hash)
	return p, nil
}

// rememberUnknown refuses hash until until, forgetting an arbitrary other
// unknown token when MaxUnknown are remembered.
func (c *VerifiedCache) rememberUnknown(hash [sha256.Size]byte, until time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.unknown == nil {
		c.unknown = map[[sha256.Size]byte]time.Time{}
	}
	if _, ok := c.unknown[hash]; !ok && len(c.unknown) >= MaxUnknown {
		for h := range c.unknown {
			delete(c.unknown, h)
			break
		}
	}
	c.unknown[hash] = until
}
