package outbox

// ClaimStatements returns the claim's statements as a claim of one shard
// group (group) or of one server runs them, for exporter's items.
func ClaimStatements(exporter string, group bool) map[string]string {
	f := claimFilter{exporter: exporter, group: group}
	return map[string]string{
		"best_effort":  f.apply(sqlClaimBestEffort),
		"per_key_one":  f.apply(sqlClaimPerKeyOne),
		"per_key_keys": f.apply(sqlClaimKeys),
		"loose":        f.apply(sqlClaimKeysLoose),
		"per_key":      f.apply(sqlClaimPerKey),
	}
}

// SQLClaimAbandoned is the statement that writes a distributed claim's
// abandoned attempts.
const SQLClaimAbandoned = sqlClaimAbandoned

// SQLClaimLockGroupKeys is the statement that locks the loose scan's keys
// in a claim of one shard group.
const SQLClaimLockGroupKeys = sqlClaimLockGroupKeys

// SpansShards is spansShards.
var SpansShards = spansShards

// IsKeyConflict is isKeyConflict.
var IsKeyConflict = isKeyConflict

// ClaimProbe is the probe of quiet groups for one exporter's claims.
func ClaimProbe(exporter string) string {
	return claimFilter{exporter: exporter, group: true}.apply(sqlClaimProbe)
}
