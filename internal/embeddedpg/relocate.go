package embeddedpg

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
)

// fallbackRoot is where Fallback puts data directories: under /var/lib,
// where only root creates entries, so that no other user can make one
// first or plant anything in it.
const fallbackRoot = "/var/lib/tally-dev"

// Unreachable reports whether, when this process is root, dataDir cannot
// serve as a default and must move (Fallback): the unprivileged user that
// runs PostgreSQL (user, or the default) could not reach it because an
// ancestor bars it — a checkout under /root, say — or a user other than
// root could change what it names — a checkout another user owns (see
// checkTrusted). It is false when the process is not root, and when the
// only problem is dataDir's mode: Start grants search permission on a data
// directory root owns.
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
	return checkReachable(filepath.Dir(abs), as) != nil || checkTrusted(abs) != nil
}

// Fallback is a data directory the unprivileged user can reach, standing
// for dataDir: the same for the same absolute path on every call, so that
// every command of one checkout finds the same cluster. It lives under
// /var/lib/tally-dev, which survives a reboot and which only root can add
// to.
func Fallback(dataDir string) string {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		abs = dataDir
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(fallbackRoot, hex.EncodeToString(sum[:6]))
}
