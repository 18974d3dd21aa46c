package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// S3Store is a Store in a bucket of an S3-compatible server, through
// minio-go. An object is streamed as a multipart upload of PartSize parts
// (the memory an upload holds), which the server shows under its name only
// once completed on Commit; Abort cancels the upload.
type S3Store struct {
	client         *minio.Client
	bucket, prefix string
	partSize       uint64
	insecure       bool
}

// NewS3Store opens the bucket under prefix, and checks that it exists.
func NewS3Store(ctx context.Context, bucket, prefix string, opts S3Options) (*S3Store, error) {
	endpoint := opts.Endpoint
	if endpoint == "" {
		endpoint = "s3.amazonaws.com"
	}
	if u, err := url.Parse(endpoint); err == nil && (u.Scheme == "http" || u.Scheme == "https") {
		endpoint, opts.Insecure = u.Host, opts.Insecure || u.Scheme == "http"
	}
	var creds *credentials.Credentials
	if opts.AccessKey != "" || opts.SecretKey != "" {
		creds = credentials.NewStaticV4(opts.AccessKey, opts.SecretKey, "")
	} else {
		creds = credentials.New(&credentials.EnvAWS{})
	}
	client, err := minio.New(endpoint, &minio.Options{Creds: creds, Secure: !opts.Insecure, Region: opts.Region,
		BucketLookup: minio.BucketLookupPath})
	if err != nil {
		return nil, fmt.Errorf("archive: s3 endpoint %s: %w", endpoint, err)
	}
	ok, err := client.BucketExists(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("archive: s3 bucket %s at %s: %w", bucket, endpoint, err)
	}
	if !ok {
		return nil, fmt.Errorf("archive: s3 bucket %s does not exist at %s", bucket, endpoint)
	}
	part := opts.PartSize
	if part == 0 {
		part = DefaultPartSize
	}
	return &S3Store{client: client, bucket: bucket, prefix: prefix, partSize: part, insecure: opts.Insecure}, nil
}

// String is the store's URL, as TALLY_ARCHIVE_URL names it (the endpoint
// is a setting of its own).
func (s *S3Store) String() string { return "s3://" + path.Join(s.bucket, s.prefix) }

func (s *S3Store) key(name string) string { return path.Join(s.prefix, name) }

// Create starts a multipart upload of name fed by a pipe.
func (s *S3Store) Create(ctx context.Context, name string) (Pending, error) {
	if ok, err := s.Exists(ctx, name); err != nil {
		return nil, err
	} else if ok {
		return nil, fmt.Errorf("%w: %s", ErrExists, name)
	}
	ctx, cancel := context.WithCancel(ctx)
	r, w := io.Pipe()
	p := &s3Pending{w: w, cancel: cancel, done: make(chan error, 1), store: s, name: name}
	go func() {
		_, err := s.client.PutObject(ctx, s.bucket, s.key(name), r, -1, minio.PutObjectOptions{
			PartSize: s.partSize, NumThreads: 1, ContentType: "application/octet-stream",
			// Over plain HTTP minio-go would sign every chunk (aws-chunked
			// encoding), which not every S3-compatible server decodes; the
			// archive's own check is verify's sha256 of each object re-read.
			DisableContentSha256: s.insecure})
		_ = r.CloseWithError(err)
		p.done <- err
	}()
	return p, nil
}

type s3Pending struct {
	w      *io.PipeWriter
	cancel context.CancelFunc
	done   chan error
	store  *S3Store
	name   string
}

func (p *s3Pending) Write(b []byte) (int, error) { return p.w.Write(b) }

// Commit ends the stream and waits for the upload to complete.
func (p *s3Pending) Commit() error {
	_ = p.w.Close()
	err := <-p.done
	p.cancel()
	if err != nil {
		return fmt.Errorf("archive: uploading %s: %w", p.name, err)
	}
	return nil
}

// Abort cancels the upload; minio-go aborts the multipart upload, so that
// no object appears.
func (p *s3Pending) Abort() {
	p.cancel()
	_ = p.w.CloseWithError(errors.New("archive: aborted"))
	<-p.done
}

// Open reads name.
func (s *S3Store) Open(ctx context.Context, name string) (Object, error) {
	info, err := s.client.StatObject(ctx, s.bucket, s.key(name), minio.StatObjectOptions{})
	if err != nil {
		if minio.ToErrorResponse(err).StatusCode == http.StatusNotFound {
			return nil, fmt.Errorf("%w: %s", ErrNotExist, name)
		}
		return nil, fmt.Errorf("archive: %s: %w", name, err)
	}
	obj, err := s.client.GetObject(ctx, s.bucket, s.key(name), minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("archive: %s: %w", name, err)
	}
	return s3Object{Object: obj, size: info.Size}, nil
}

type s3Object struct {
	*minio.Object
	size int64
}

func (o s3Object) Size() int64 { return o.size }

// Exists says whether name is committed.
func (s *S3Store) Exists(ctx context.Context, name string) (bool, error) {
	_, err := s.client.StatObject(ctx, s.bucket, s.key(name), minio.StatObjectOptions{})
	if err == nil {
		return true, nil
	}
	if minio.ToErrorResponse(err).StatusCode == http.StatusNotFound {
		return false, nil
	}
	return false, fmt.Errorf("archive: %s: %w", name, err)
}
