package embeddedpg

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// openServerLog opens DataDir/postgres.log for appending, owned by as (the
// user that runs PostgreSQL) when tally is root. It refuses a log that is a
// link, or that neither tally's user nor as owns.
func openServerLog(dataDir string, as *runAs) (*os.File, error) {
	logFile, err := openFile(filepath.Join(dataDir, logName), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: open server log: %w", err)
	}
	fi, err := logFile.Stat()
	if err == nil {
		if uid, _, ok := fileOwner(fi); ok && !trustedOwner(uid) && (as == nil || uid != as.uid) {
			err = fmt.Errorf("%s is owned by uid %d%s, neither tally's user nor the one that runs PostgreSQL", logFile.Name(), uid, userName(uid))
		}
	}
	if err == nil {
		err = as.chown(logFile)
	}
	if err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("embeddedpg: server log: %w", err)
	}
	return logFile, nil
}

// openFile opens path like os.OpenFile, but refuses a symbolic link (the
// open fails rather than follows it) and anything but a regular file with
// a single link, so that no file elsewhere is reached through path.
func openFile(path string, flag int, perm os.FileMode) (*os.File, error) {
	f, err := os.OpenFile(path, flag|noFollow, perm)
	if err != nil {
		if fi, lerr := os.Lstat(path); lerr == nil && fi.Mode()&os.ModeSymlink != 0 {
			return nil, fmt.Errorf("%s is a symbolic link; refusing to follow it", path)
		}
		return nil, err
	}
	fi, err := f.Stat()
	switch {
	case err != nil:
	case !fi.Mode().IsRegular():
		err = fmt.Errorf("%s is not a regular file", path)
	case fileLinks(fi) != 1:
		err = fmt.Errorf("%s has %d hard links; refusing to use it", path, fileLinks(fi))
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

// readFile reads path like os.ReadFile, through openFile.
func readFile(path string) ([]byte, error) {
	f, err := openFile(path, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

func newPassword() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("embeddedpg: generate password: %w", err)
	}
	return hex.EncodeToString(b), nil
}

func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, werr := f.Write(data)
	merr := f.Chmod(perm)
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, merr, serr, cerr); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}

func fileSize(f *os.File) int64 {
	if fi, err := f.Stat(); err == nil {
		return fi.Size()
	}
	return 0
}

// logTail returns the last logTailLines lines written to path after offset.
func logTail(path string, offset int64) string {
	f, err := openFile(path, os.O_RDONLY, 0)
	if err != nil {
		return "(server log unavailable: " + err.Error() + ")"
	}
	defer f.Close()
	const maxRead = 64 << 10
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > maxRead {
		offset = fi.Size() - maxRead
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return "(server log unavailable: " + err.Error() + ")"
	}
	b, _ := io.ReadAll(f)
	lines := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	out := strings.Join(lines, "\n")
	if strings.TrimSpace(out) == "" {
		return "(server log is empty)"
	}
	return out
}
