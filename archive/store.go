package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"path/filepath"
	"strings"
)

// Store is where archive files live: a directory (DirStore) or an
// S3-compatible bucket (S3Store). Names are slash-separated paths below
// the store's root, such as "2027-01/g0001/usage_events.parquet".
//
// A store never overwrites and never deletes a committed object: Create
// writes to a temporary name (or an uncommitted multipart upload) that
// becomes name only on Commit, and Commit refuses a name that exists.
type Store interface {
	// Create starts writing the object name.
	Create(ctx context.Context, name string) (Pending, error)
	// Open reads the object name; ErrNotExist when there is none.
	Open(ctx context.Context, name string) (Object, error)
	// Exists says whether the object name is committed.
	Exists(ctx context.Context, name string) (bool, error)
	// String is the store's location without any credential.
	String() string
}

// Pending is an object being written: nothing is visible under its name
// until Commit returns nil. Abort (or a failed Commit) leaves nothing.
type Pending interface {
	io.Writer
	Commit() error
	Abort()
}

// Object is a committed object opened for reading, streamed (Read) or at
// random (ReadAt, for Parquet's footer and column chunks).
type Object interface {
	io.Reader
	io.ReaderAt
	io.Closer
	Size() int64
}

// ErrNotExist is returned by Open for an object that is not there.
var ErrNotExist = errors.New("archive: no such object")

// ErrExists is returned by Commit for a name that is taken: an archive is
// never overwritten.
var ErrExists = errors.New("archive: object exists already")

// S3Options are the settings of an S3-compatible store besides its URL.
type S3Options struct {
	// Endpoint is the server: host[:port] (HTTPS), or a URL whose scheme
	// says http or https (TALLY_ARCHIVE_ENDPOINT). Defaults to
	// s3.amazonaws.com.
	Endpoint string
	// Region is the bucket's region; empty lets the client ask.
	Region string
	// AccessKey and SecretKey are the credentials; both empty means
	// anonymous access.
	AccessKey, SecretKey string
	// Insecure speaks plain HTTP to the endpoint (tests, a local server),
	// as an http:// Endpoint does. Defaults to false: HTTPS.
	Insecure bool
	// PartSize is the size of each part of a multipart upload, which is
	// also the memory an upload holds. Defaults to DefaultPartSize.
	PartSize uint64
}

// DefaultPartSize is the part size of an S3 upload: 16 MiB.
const DefaultPartSize = 16 << 20

// OpenStore opens the store TALLY_ARCHIVE_URL names: a plain path or a
// file:// URL for a directory (created if missing), s3://bucket/prefix for
// a bucket, reached with opts.
func OpenStore(ctx context.Context, raw string, opts S3Options) (Store, error) {
	if raw == "" {
		return nil, errors.New("archive: no store: TALLY_ARCHIVE_URL is empty")
	}
	if !strings.Contains(raw, "://") {
		return NewDirStore(raw)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("archive: TALLY_ARCHIVE_URL: %w", err)
	}
	switch u.Scheme {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return nil, fmt.Errorf("archive: file URL with host %q: want file:///path", u.Host)
		}
		return NewDirStore(filepath.FromSlash(u.Path))
	case "s3":
		if u.Host == "" {
			return nil, errors.New("archive: s3 URL without a bucket: want s3://bucket/prefix")
		}
		return NewS3Store(ctx, u.Host, strings.Trim(u.Path, "/"), opts)
	}
	return nil, fmt.Errorf("archive: TALLY_ARCHIVE_URL scheme %q: want a path, file:// or s3://", u.Scheme)
}
