//go:build unix

package pgbouncer

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// unprivileged makes cmd die with the test process and run as the test
// cluster's user (testdb.ClusterUser) when the tests run as root, PgBouncer
// refusing to run as root, and gives that user dir and the files in it.
func unprivileged(cmd *exec.Cmd, dir string) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{}
	setPdeathsig(cmd.SysProcAttr)
	if os.Geteuid() != 0 {
		return nil
	}
	uid, gid, err := testdb.ClusterUser()
	if err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.Lchown(filepath.Join(dir, e.Name()), uid, gid); err != nil {
			return err
		}
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		return err
	}
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	return nil
}
