package testdb

import (
	"os"
	"syscall"
)

// scratchRoot is where the throwaway cluster lives: /dev/shm when it is a
// memory file system with room to spare (a database is created there far
// faster than on a disk that syncs), otherwise the temporary directory.
// Clusters dead processes left in either are removed first.
func scratchRoot() string {
	sweep("/dev/shm", os.TempDir())
	const tmpfsMagic = 0x01021994
	var st syscall.Statfs_t
	if err := syscall.Statfs("/dev/shm", &st); err == nil && st.Type == tmpfsMagic &&
		st.Bavail*uint64(st.Bsize) >= 2<<30 && syscall.Access("/dev/shm", 0o2|0o1) == nil {
		return "/dev/shm"
	}
	return os.TempDir()
}
