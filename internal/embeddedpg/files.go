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
// user that runs PostgreSQL) when tally is root.
func openServerLog(dataDir string, as *runAs) (*os.File, error) {
	logPath := filepath.Join(dataDir, logName)
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: open server log: %w", err)
	}
	if err := as.chown(logPath); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("embeddedpg: chown server log: %w", err)
	}
	return logFile, nil
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
	serr := f.Sync()
	cerr := f.Close()
	if err := errors.Join(werr, serr, cerr, os.Chmod(tmp, perm)); err != nil {
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
	f, err := os.Open(path)
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
