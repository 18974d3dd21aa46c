// Package tenantbucket computes a tenant's bucket: the key every table
// that holds a tenant's usage and items carries, by which a distributed
// database (Citus) places them, a tenant's rows all in one place. It is
// the Go twin of the database's tally_bucket(tenant), which every such
// table's CHECK compares with the bucket written; and how the buckets are
// placed (Shards), which a statement over many tenants is split by.
package tenantbucket

import (
	"crypto/sha256"
	"encoding/binary"
)

// Count is how many buckets there are, numbered 0 to Count-1.
const Count = 1024

// Of is tenant's bucket: the first two bytes of the SHA-256 of its UTF-8
// bytes, as a big-endian integer, mod Count — tally_bucket(tenant).
func Of(tenant string) int16 {
	sum := sha256.Sum256([]byte(tenant))
	return int16(binary.BigEndian.Uint16(sum[:2]) & (Count - 1))
}

// All is every bucket, in order: the list a statement carries that acts
// on every tenant at once.
func All() []int16 {
	all := make([]int16, Count)
	for i := range all {
		all[i] = int16(i)
	}
	return all
}
