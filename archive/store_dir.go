package archive

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// DirStore is a Store in a directory of the local file system (or a
// mounted one). Objects are written to a hidden temporary file beside
// their name, synced, and linked to their name on Commit, which fails if
// the name exists: nothing is ever overwritten.
type DirStore struct{ root string }

// NewDirStore opens (creating it if missing) the directory root.
func NewDirStore(root string) (*DirStore, error) {
	if root == "" {
		return nil, errors.New("archive: empty directory")
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("archive: directory %s: %w", root, err)
	}
	if err := os.MkdirAll(abs, 0o750); err != nil {
		return nil, fmt.Errorf("archive: directory %s: %w", abs, err)
	}
	return &DirStore{root: abs}, nil
}

func (d *DirStore) String() string { return "file://" + filepath.ToSlash(d.root) }

func (d *DirStore) path(name string) (string, error) {
	clean := path.Clean(name)
	if clean != name || path.IsAbs(name) || strings.HasPrefix(clean, "..") || name == "" {
		return "", fmt.Errorf("archive: bad object name %q", name)
	}
	return filepath.Join(d.root, filepath.FromSlash(name)), nil
}

// Create starts writing name in a temporary file of the same directory.
func (d *DirStore) Create(_ context.Context, name string) (Pending, error) {
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	tmp := filepath.Join(filepath.Dir(p), "."+filepath.Base(p)+".tmp-"+hex.EncodeToString(b[:]))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	return &dirPending{f: f, tmp: tmp, final: p}, nil
}

type dirPending struct {
	f          *os.File
	tmp, final string
}

func (p *dirPending) Write(b []byte) (int, error) { return p.f.Write(b) }

// Commit syncs the file and links it to its name (refused if the name
// exists), then syncs the directory.
func (p *dirPending) Commit() error {
	defer func() { _ = os.Remove(p.tmp) }()
	if err := p.f.Sync(); err != nil {
		_ = p.f.Close()
		return fmt.Errorf("archive: %w", err)
	}
	if err := p.f.Close(); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	if err := os.Link(p.tmp, p.final); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %s", ErrExists, p.final)
		}
		return fmt.Errorf("archive: %w", err)
	}
	if dir, err := os.Open(filepath.Dir(p.final)); err == nil {
		_ = dir.Sync()
		_ = dir.Close()
	}
	return nil
}

func (p *dirPending) Abort() {
	_ = p.f.Close()
	_ = os.Remove(p.tmp)
}

// Open opens name for reading.
func (d *DirStore) Open(_ context.Context, name string) (Object, error) {
	p, err := d.path(name)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNotExist, name)
	}
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("archive: %w", err)
	}
	return dirObject{File: f, size: st.Size()}, nil
}

type dirObject struct {
	*os.File
	size int64
}

func (o dirObject) Size() int64 { return o.size }

// Exists says whether name is committed.
func (d *DirStore) Exists(_ context.Context, name string) (bool, error) {
	p, err := d.path(name)
	if err != nil {
		return false, err
	}
	_, err = os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}
