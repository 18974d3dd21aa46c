package archive

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/stretchr/testify/require"
)

// TestArchiveToS3 archives and verifies a month in an S3 bucket: the
// in-process S3 protocol server gofakes3 (a real S3 server, SeaweedFS,
// is too heavy to build on CI), reached by minio-go over HTTP.
func TestArchiveToS3(t *testing.T) {
	t.Parallel()
	backend := s3mem.New()
	require.NoError(t, backend.CreateBucket("tally"))
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)

	b := setup(t)
	_, err := OpenStore(b.Ctx, "s3://missing/x", S3Options{Endpoint: strings.TrimPrefix(srv.URL, "http://"), Insecure: true,
		AccessKey: "key", SecretKey: "secret"})
	require.ErrorContains(t, err, "does not exist")

	store, err := OpenStore(b.Ctx, "s3://tally/archives", S3Options{Endpoint: strings.TrimPrefix(srv.URL, "http://"),
		Insecure: true, AccessKey: "key", SecretKey: "secret", PartSize: 5 << 20})
	require.NoError(t, err)
	b.closedMonth(t)
	cfg := Config{Store: store, By: "test"}
	res, err := Archive(b.Ctx, b.Pool, b.period, cfg)
	require.NoError(t, err)
	require.Contains(t, res.Manifest.Location, "s3://tally/archives/"+b.period+"/g0001")
	ok, err := store.Exists(b.Ctx, b.period+"/g0001/"+manifestName)
	require.NoError(t, err)
	require.True(t, ok)

	// Nothing is written over.
	p, err := store.Create(b.Ctx, b.period+"/g0001/"+manifestName)
	require.ErrorIs(t, err, ErrExists)
	require.Nil(t, p)

	_, err = Verify(b.Ctx, b.Pool, b.period, 0, cfg)
	require.NoError(t, err)

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
	_, err = backend.PutObject("tally", "archives/"+b.period+"/g0001/"+fileEvents, map[string]string{},
		strings.NewReader("not parquet"), int64(len("not parquet")), nil)
	require.NoError(t, err)
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
