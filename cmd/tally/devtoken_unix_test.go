//go:build unix

package main

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
)

// dev makes its token files 0600 and reuses them on the next start.
func TestDevTokenFileMadeThenReused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	first, err := devToken(dir, "dev-admin-token")
	require.NoError(t, err)
	fi, err := os.Stat(filepath.Join(dir, "dev-admin-token"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	again, err := devToken(dir, "dev-admin-token")
	require.NoError(t, err)
	require.Equal(t, first, again)
}

// A token file group or others may read or write, a link, or a file of
// another user is not one dev made: dev refuses it, naming the file and
// why, and never uses its content.
func TestDevRefusesTokenFilesItDidNotMake(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	planted := "tly_tok_planted-by-someone-else-0123456789abcdef"

	open := filepath.Join(dir, "dev-admin-token")
	require.NoError(t, os.WriteFile(open, []byte(planted+"\n"), 0o600))
	require.NoError(t, os.Chmod(open, 0o644))
	got, err := devToken(dir, "dev-admin-token")
	require.Empty(t, got)
	require.ErrorContains(t, err, open+" has mode 0644: group or others may read or change it")
	require.ErrorContains(t, err, "tally dev did not make it")
	require.NotContains(t, err.Error(), planted)

	target := filepath.Join(dir, "elsewhere")
	require.NoError(t, os.WriteFile(target, []byte(planted+"\n"), 0o600))
	link := filepath.Join(dir, "dev-ingest-token")
	require.NoError(t, os.Symlink(target, link))
	_, err = devToken(dir, "dev-ingest-token")
	require.ErrorContains(t, err, link+" is not a regular file")

	// Another user's file: as root, a real one; otherwise its metadata.
	theirs := filepath.Join(t.TempDir(), "dev-admin-token")
	require.NoError(t, os.WriteFile(theirs, []byte(planted+"\n"), 0o600))
	if os.Getuid() == 0 {
		require.NoError(t, os.Chown(theirs, 65534, 65534))
		_, err = devToken(filepath.Dir(theirs), "dev-admin-token")
		require.ErrorContains(t, err, theirs+" is owned by uid 65534, not by this user (uid 0)")
	}
	fi, err := os.Stat(theirs)
	require.NoError(t, err)
	require.Contains(t, config.OwnerProblem(otherOwner{fi}), "is owned by uid 4242, not by this user")
	require.Empty(t, config.OwnerProblem(mustStat(t, filepath.Join(dir, "elsewhere"))), "its own 0600 file is fine")
}

// otherOwner is a file's metadata as if uid 4242 owned it.
type otherOwner struct{ os.FileInfo }

func (o otherOwner) Sys() any {
	st := *o.FileInfo.Sys().(*syscall.Stat_t)
	st.Uid = 4242
	return &st
}

func mustStat(t *testing.T, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi
}
