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

// probeLock reports whether a shared flock on f can be taken at once, that
// is, whether no other open file holds an exclusive one. The lock taken
// lasts until f is closed.
func probeLock(f *os.File) bool {
	return syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB) == nil
}
