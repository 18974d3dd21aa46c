package embeddedpg

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
)

// fallbackRoot is where Fallback puts data directories.
const fallbackRoot = "/var/tmp"

// Unreachable reports whether, when this process is root, the unprivileged
// user that runs PostgreSQL (user, or the default) could not reach dataDir
// because an ancestor bars it — a checkout under /root, say. It is false
// when the process is not root, and when the problem is dataDir itself:
// Start grants search permission on a data directory root owns.
func Unreachable(dataDir, user string) bool {
	if os.Geteuid() != 0 {
		return false
	}
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		return false
	}
	as, err := lookupRunAs(user)
	if err != nil {
		return false // Start reports it
	}
	return checkReachable(filepath.Dir(abs), as) != nil
}

// Fallback is a data directory the unprivileged user can reach, standing
// for dataDir: the same for the same absolute path on every call, so that
// every command of one checkout finds the same cluster. It lives under
// /var/tmp, which survives a reboot.
func Fallback(dataDir string) string {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		abs = dataDir
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(fallbackRoot, "tally-"+hex.EncodeToString(sum[:6]))
}
