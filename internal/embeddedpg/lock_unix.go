//go:build unix

package embeddedpg

import (
	"errors"
	"os"
	"syscall"
)

// lockFile takes an exclusive flock on f without waiting: errLockBusy when
// another open file holds one.
func lockFile(f *os.File) error {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return errLockBusy
	}
	return err
}
