//go:build unix

package embeddedpg

import (
	"os"
	"syscall"
)

// credential is the identity a child process takes: r's, or the parent's
// own when r is nil.
func (r *runAs) credential() *syscall.Credential {
	if r == nil {
		return nil
	}
	// An empty Groups clears root's supplementary groups in the child.
	return &syscall.Credential{Uid: r.uid, Gid: r.gid, Groups: r.groups}
}

// fileOwner returns the owning uid and gid of the file fi describes.
func fileOwner(fi os.FileInfo) (uid, gid uint32, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return st.Uid, st.Gid, true
}
