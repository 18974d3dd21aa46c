package archive

import (
	"bytes"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/stretchr/testify/require"
)

// envS3 points TestArchiveToS3 at a real S3-compatible server instead of
// the in-process one: "ENDPOINT ACCESS_KEY SECRET_KEY BUCKET", ENDPOINT an
// http:// or https:// URL, the bucket existing (e.g. SeaweedFS's
// "weed server -s3").
const envS3 = "TALLY_TEST_S3"

// s3Server is where TestArchiveToS3 archives: the server's endpoint and
// keys, the bucket, and a way to write an object behind the store's back.
type s3Server struct {
	opts   S3Options
	bucket string
	put    func(t *testing.T, key string, data []byte)
}

// newS3Server is the server envS3 names, or gofakes3 (an in-process S3
// protocol server: building and running SeaweedFS takes minutes of a
// 2-core CI machine).
func newS3Server(t *testing.T) s3Server {
	if spec := os.Getenv(envS3); spec != "" {
		f := strings.Fields(spec)
		require.Len(t, f, 4, envS3)
		u, err := url.Parse(f[0])
		require.NoError(t, err)
		client, err := minio.New(u.Host, &minio.Options{Creds: credentials.NewStaticV4(f[1], f[2], ""), Secure: u.Scheme == "https"})
		require.NoError(t, err)
		return s3Server{opts: S3Options{Endpoint: f[0], AccessKey: f[1], SecretKey: f[2]}, bucket: f[3],
			put: func(t *testing.T, key string, data []byte) {
				_, err := client.PutObject(t.Context(), f[3], key, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{})
				require.NoError(t, err)
			}}
	}
	backend := s3mem.New()
	require.NoError(t, backend.CreateBucket("tally"))
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)
	return s3Server{opts: S3Options{Endpoint: srv.URL, AccessKey: "key", SecretKey: "secret"}, bucket: "tally",
		put: func(t *testing.T, key string, data []byte) {
			_, err := backend.PutObject("tally", key, map[string]string{}, bytes.NewReader(data), int64(len(data)), nil)
			require.NoError(t, err)
		}}
}

// TestArchiveToS3 archives, verifies and restores a month in an S3
// bucket, reached by minio-go over HTTP: gofakes3 by default, a real
// server with TALLY_TEST_S3.
func TestArchiveToS3(t *testing.T) {
	t.Parallel()
	srv := newS3Server(t)
	b := setup(t)
	_, err := OpenStore(b.Ctx, "s3://missing-bucket-"+strings.ToLower(b.period)+"/x", srv.opts)
	require.ErrorContains(t, err, "does not exist")

	prefix := "archives-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	opts := srv.opts
	opts.PartSize = 5 << 20
	store, err := OpenStore(b.Ctx, "s3://"+srv.bucket+"/"+prefix, opts)
	require.NoError(t, err)
	b.closedMonth(t)
	cfg := Config{Store: store, By: "test"}
	res, err := Archive(b.Ctx, b.Pool, b.period, cfg)
	require.NoError(t, err)
	require.Equal(t, "s3://"+srv.bucket+"/"+prefix+"/"+b.period+"/g0001", res.Manifest.Location)
	ok, err := store.Exists(b.Ctx, b.period+"/g0001/"+manifestName)
	require.NoError(t, err)
	require.True(t, ok)

	// Nothing is written over.
	p, err := store.Create(b.Ctx, b.period+"/g0001/"+manifestName)
	require.ErrorIs(t, err, ErrExists)
	require.Nil(t, p)

	_, err = Verify(b.Ctx, b.Pool, b.period, 0, cfg)
	require.NoError(t, err)
	restored, err := Restore(b.Ctx, b.Pool, store, b.period, 0, "audit_s3")
	require.NoError(t, err)
	require.EqualValues(t, 10, restored.Rows["usage_events"])

	// An aborted upload leaves nothing.
	p, err = store.Create(b.Ctx, "aborted.parquet")
	require.NoError(t, err)
	_, err = p.Write([]byte("partial"))
	require.NoError(t, err)
	p.Abort()
	ok, err = store.Exists(b.Ctx, "aborted.parquet")
	require.NoError(t, err)
	require.False(t, ok)

	// A corrupted object fails verify, naming it.
	srv.put(t, prefix+"/"+b.period+"/g0001/"+fileEvents, []byte("not parquet"))
	_, err = Verify(b.Ctx, b.Pool, b.period, 0, cfg)
	require.ErrorIs(t, err, ErrVerifyFailed)
	require.Contains(t, err.Error(), fileEvents+": ")
}

func TestOpenStore(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, u := range []string{dir, "file://" + dir} {
		s, err := OpenStore(t.Context(), u, S3Options{})
		require.NoError(t, err)
		require.Equal(t, "file://"+dir, s.String())
	}
	for _, bad := range []string{"", "ftp://x/y", "s3:///prefix", "file://host/path"} {
		_, err := OpenStore(t.Context(), bad, S3Options{})
		require.Error(t, err, bad)
	}
}
