//go:build unix

package embeddedpg

import (
	"os"
	"syscall"
)

// noFollow makes an open fail on a symbolic link rather than follow it.
const noFollow = syscall.O_NOFOLLOW

// openDir opens the directory path, failing on a symbolic link.
func openDir(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|syscall.O_DIRECTORY|noFollow, 0)
}

// fileLinks returns the number of hard links to the file fi describes.
func fileLinks(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Nlink)
	}
	return 1
}
