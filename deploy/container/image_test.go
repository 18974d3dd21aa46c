//go:build linux

// Package container_test builds the container image with `make image` and
// checks it: what podman says of it, what its root filesystem holds, and
// that it serves against a test Postgres as its non-root user until
// /readyz?scope=ingest answers 200. Linux only, as podman and the chroot
// it falls back to are.
package container_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// envRequire names the variable that, set, makes a missing podman fail the
// image test instead of skipping it (.ci/run sets it).
const envRequire = "TALLY_REQUIRE_PODMAN"

// maxImageSize is the most the image may weigh, in bytes.
const maxImageSize = 60_000_000

// noURL is what the image's serve says without TALLY_DATABASE_URL.
const noURL = "TALLY_DATABASE_URL is not set, and this image has no embedded PostgreSQL"

const (
	buildTimeout   = 10 * time.Minute
	podmanTimeout  = 2 * time.Minute
	readyTimeout   = time.Minute
	stopTimeout    = 30 * time.Second
	repositoryRoot = "../.."
)

func TestMain(m *testing.M) { testdb.Main(m) }

// imageInfo is what the test reads of `podman image inspect`.
type imageInfo struct {
	Size   int64
	Config struct {
		User       string
		Entrypoint []string
		Cmd        []string
		Env        []string
		Labels     map[string]string
	}
	Healthcheck *struct{ Test []string }
}

// TestImageServesAsNonRootFromScratch builds the image with make image and
// checks it: below maxImageSize, a numeric non-root user, tally serve by
// default, tally healthcheck as its health check, the OCI labels with the
// version git describes; a root filesystem of a static binary and the CA
// certificates, no shell. Then it runs the image, as that user: without
// TALLY_DATABASE_URL it says so in one line and exits 2; with a test
// database, as a runtime login, it answers /readyz?scope=ingest with 200,
// passes its health check, logs its version and stops cleanly on SIGTERM.
// Where podman cannot run a container (crun refuses on some hosts), it
// runs the image's entrypoint from its root filesystem, in a chroot as the
// image's user, and says why.
func TestImageServesAsNonRootFromScratch(t *testing.T) {
	t.Parallel()
	podman := requirePodman(t)
	describe := git(t, "describe", "--always", "--dirty")
	tag := build(t, podman)
	img := inspect(t, podman, tag)

	t.Logf("image %s: %.1f MB (%d bytes)", tag, float64(img.Size)/1e6, img.Size)
	require.Less(t, img.Size, int64(maxImageSize))
	uid, gid := numericUser(t, img.Config.User)
	require.NotZero(t, uid, "the image runs as root")
	require.Equal(t, []string{"/tally"}, img.Config.Entrypoint)
	require.Equal(t, []string{"serve"}, img.Config.Cmd)
	require.NotNil(t, img.Healthcheck, "no HEALTHCHECK: was the image built in Docker's format?")
	require.Equal(t, []string{"CMD", "/tally", "healthcheck"}, img.Healthcheck.Test)
	labels := img.Config.Labels
	require.Equal(t, "https://github.com/tallymeter/tally", labels["org.opencontainers.image.source"])
	require.Equal(t, describe, labels["org.opencontainers.image.version"])
	require.Equal(t, git(t, "rev-parse", "HEAD"), labels["org.opencontainers.image.revision"])

	root := exportRoot(t, podman, tag)
	require.FileExists(t, filepath.Join(root, "etc/ssl/certs/ca-certificates.crt"))
	for _, shell := range []string{"bin/sh", "bin/bash", "bin/busybox", "usr/bin/env"} {
		require.NoFileExists(t, filepath.Join(root, shell))
	}
	bin, err := elf.Open(filepath.Join(root, "tally"))
	require.NoError(t, err)
	for _, p := range bin.Progs {
		require.NotEqual(t, elf.PT_INTERP, p.Type, "the binary is linked dynamically")
	}
	require.NoError(t, bin.Close())

	r := &runner{t: t, podman: podman, tag: tag, img: img, root: root, uid: uid, gid: gid}
	code, out := r.probe()
	require.Equal(t, 2, code, out)
	require.Contains(t, out, noURL)
	require.NotContains(t, strings.TrimSpace(out), "\n", "one line")

	owner := testdb.URL(t)
	addr := freeAddr(t)
	env := []string{"TALLY_DATABASE_URL=" + runtimeLogin(t, owner), "TALLY_DATABASE_OWNER_URL=" + owner, "TALLY_LISTEN=" + addr}
	node := r.start(env)
	for deadline := time.Now().Add(readyTimeout); ; time.Sleep(100 * time.Millisecond) {
		if status(t, "http://"+addr+"/readyz?scope=ingest") == http.StatusOK {
			break
		}
		require.True(t, time.Now().Before(deadline), "/readyz?scope=ingest never answered 200:\n%s", node.output())
	}
	code, out = r.run([]string{"healthcheck"}, []string{"TALLY_LISTEN=" + addr})
	require.Equal(t, 0, code, out)
	require.Contains(t, node.output(), `"msg":"tally starting"`)
	require.Contains(t, node.output(), `"version":"`+describe+`"`)
	require.Equal(t, 0, node.stop(), "serve did not stop cleanly on SIGTERM:\n%s", node.output())
}

// requirePodman returns podman's path, or skips t saying why (fails it
// under envRequire).
func requirePodman(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("podman")
	if err != nil {
		if os.Getenv(envRequire) != "" {
			t.Fatalf("podman is missing and %s is set: apt-get install podman", envRequire)
		}
		t.Skipf("podman is missing (apt-get install podman; set %s to fail instead): the image is not built or checked", envRequire)
	}
	return path
}

// build runs make image with a tag of the test's own, removed when t ends.
func build(t *testing.T, podman string) string {
	t.Helper()
	tag := "localhost/tally-image-test:" + randomHex(4)
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "make", "-C", repositoryRoot, "image", "IMAGE="+tag)
	out, err := cmd.CombinedOutput()
	t.Cleanup(func() {
		if out, err := podmanOutput(podman, "image", "rm", "--force", tag); err != nil {
			t.Errorf("removing %s: %v\n%s", tag, err, out)
		}
	})
	require.NoError(t, err, "make image:\n%s", out)
	return tag
}

func inspect(t *testing.T, podman, tag string) imageInfo {
	t.Helper()
	out, err := podmanOutput(podman, "image", "inspect", tag)
	require.NoError(t, err, "%s", out)
	var infos []imageInfo
	require.NoError(t, json.Unmarshal(out, &infos), "%s", out)
	require.Len(t, infos, 1)
	return infos[0]
}

// numericUser parses the image's user, which must be numeric (uid:gid) so
// that a runtime can tell it is not root without an /etc/passwd.
func numericUser(t *testing.T, user string) (uint32, uint32) {
	t.Helper()
	u, g, ok := strings.Cut(user, ":")
	require.True(t, ok, "the image's user %q names no group", user)
	uid, err := strconv.ParseUint(u, 10, 32)
	require.NoError(t, err, "the image's user %q is not numeric", user)
	gid, err := strconv.ParseUint(g, 10, 32)
	require.NoError(t, err, "the image's group %q is not numeric", user)
	return uint32(uid), uint32(gid)
}

// exportRoot writes the image's root filesystem (podman export of a
// container created, never started) to a directory removed when t ends,
// and logs what it holds.
func exportRoot(t *testing.T, podman, tag string) string {
	t.Helper()
	name := "tally-image-test-" + randomHex(4)
	out, err := podmanOutput(podman, "create", "--name", name, tag)
	require.NoError(t, err, "%s", out)
	t.Cleanup(func() { _, _ = podmanOutput(podman, "rm", "--force", name) })
	root, err := os.MkdirTemp("", "tally-image-root-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	// The image's user enters it once it is the root of a chroot.
	require.NoError(t, os.Chmod(root, 0o755))

	ctx, cancel := context.WithTimeout(context.Background(), podmanTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, podman, "export", name)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	files, err := untar(stdout, root)
	_, _ = io.Copy(io.Discard, stdout)
	require.NoError(t, cmd.Wait(), "podman export: %s", stderr.String())
	require.NoError(t, err)
	t.Logf("the image's files: %s", strings.Join(files, " "))
	return root
}

// untar writes a tar stream's directories, regular files and symbolic
// links under dir and returns the files' names.
func untar(r io.Reader, dir string) ([]string, error) {
	var files []string
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files, nil
		}
		if err != nil {
			return files, err
		}
		name := strings.Trim(strings.TrimPrefix(h.Name, "./"), "/")
		if name == "" || name == "." {
			continue
		}
		if !fs.ValidPath(name) {
			return files, fmt.Errorf("unexpected path %q in the image", h.Name)
		}
		path := filepath.Join(dir, name)
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(path, 0o755)
		case tar.TypeReg:
			files = append(files, "/"+name)
			err = writeFile(path, tr, h.FileInfo().Mode().Perm())
		case tar.TypeSymlink:
			files = append(files, "/"+name+" -> "+h.Linkname)
			err = os.Symlink(h.Linkname, path)
		}
		if err != nil {
			return files, err
		}
	}
}

func writeFile(path string, r io.Reader, mode fs.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// runner runs the image: in a container where podman can run one, else
// its entrypoint from its root filesystem, in a chroot as the image's user
// (as root; otherwise as this user, outside one).
type runner struct {
	t        *testing.T
	podman   string
	tag      string
	img      imageInfo
	root     string
	uid, gid uint32
	// direct: podman cannot run a container here; set by probe.
	direct bool
}

// probe runs the image's default command without settings, to see whether
// podman runs containers here, and returns its exit status and output.
func (r *runner) probe() (int, string) {
	r.t.Helper()
	code, out := r.run(nil, nil)
	if code != 2 || !strings.Contains(out, noURL) {
		// crun refuses to start containers on some hosts (cgroups v1 in
		// hybrid mode; a host that may not raise RLIMIT_NOFILE): run the
		// root filesystem instead.
		r.t.Logf("podman run does not run the image here (exit status %d: %s); running its root filesystem instead, %s",
			code, lastLine(out), r.how())
		r.direct = true
		code, out = r.run(nil, nil)
	} else {
		r.t.Logf("podman runs the image here")
	}
	return code, out
}

func (r *runner) how() string {
	if os.Geteuid() == 0 {
		return fmt.Sprintf("chrooted into it as the image's user %d:%d", r.uid, r.gid)
	}
	return fmt.Sprintf("as this user (uid %d: not root, so no chroot and no change of user)", os.Geteuid())
}

// run runs the image with args as its command (nil: the image's) and env
// beside the image's own, and returns the exit status and the output.
func (r *runner) run(args, env []string) (int, string) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), podmanTimeout)
	defer cancel()
	var flags []string
	if !r.direct {
		name := "tally-image-test-" + randomHex(4)
		flags = []string{"--rm", "--name", name}
		// Left behind, created, when the runtime refuses to start it.
		defer func() { _, _ = podmanOutput(r.podman, "rm", "--force", name) }()
	}
	out, err := r.command(ctx, flags, args, env).CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), string(out)
	}
	require.NoError(r.t, err, "%s", out)
	return 0, string(out)
}

// command is the command that runs the image with args (nil: the image's
// command) and env: podman run with flags, or the entrypoint in the root
// filesystem.
func (r *runner) command(ctx context.Context, flags, args, env []string) *exec.Cmd {
	if args == nil {
		args = r.img.Config.Cmd
	}
	if !r.direct {
		a := append([]string{"run", "--network", "host"}, flags...)
		for _, e := range env {
			a = append(a, "--env", e)
		}
		return exec.CommandContext(ctx, r.podman, append(append(a, r.tag), args...)...)
	}
	argv := append(slices.Clone(r.img.Config.Entrypoint), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	// Only the image's environment and env, as in a container.
	cmd.Env = append(slices.Clone(r.img.Config.Env), env...)
	if os.Geteuid() == 0 {
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: r.root, Credential: &syscall.Credential{Uid: r.uid, Gid: r.gid}}
	} else {
		cmd.Path, cmd.Dir = filepath.Join(r.root, argv[0]), r.root
	}
	return cmd
}

// node is the image's serve, running.
type node struct {
	t      *testing.T
	r      *runner
	name   string          // the container's, when podman runs it
	cmd    *exec.Cmd       // the process, when the root filesystem runs
	out    *syncbuf.Buffer // the process's output
	status *int            // the exit status, once stopped
}

// start starts the image's command with env beside the image's own,
// stopped when the test ends.
func (r *runner) start(env []string) *node {
	r.t.Helper()
	n := &node{t: r.t, r: r, out: new(syncbuf.Buffer)}
	if r.direct {
		n.cmd = r.command(context.Background(), nil, nil, env)
		n.cmd.Stdout, n.cmd.Stderr = n.out, n.out
		require.NoError(r.t, n.cmd.Start())
	} else {
		n.name = "tally-image-test-" + randomHex(4)
		ctx, cancel := context.WithTimeout(context.Background(), podmanTimeout)
		defer cancel()
		out, err := r.command(ctx, []string{"--detach", "--name", n.name}, nil, env).CombinedOutput()
		r.t.Cleanup(func() { _, _ = podmanOutput(r.podman, "rm", "--force", n.name) })
		require.NoError(r.t, err, "%s", out)
	}
	r.t.Cleanup(func() {
		if n.status == nil {
			n.stop()
		}
	})
	return n
}

// output is what the node has written so far.
func (n *node) output() string {
	if n.cmd != nil {
		return n.out.String()
	}
	out, _ := podmanOutput(n.r.podman, "logs", n.name)
	return string(out)
}

// stop sends SIGTERM, waits for the node to exit (SIGKILL after
// stopTimeout) and returns its exit status.
func (n *node) stop() int {
	n.t.Helper()
	code := -1
	if n.cmd != nil {
		_ = n.cmd.Process.Signal(syscall.SIGTERM)
		timer := time.AfterFunc(stopTimeout, func() { _ = n.cmd.Process.Kill() })
		_ = n.cmd.Wait()
		timer.Stop()
		code = n.cmd.ProcessState.ExitCode()
	} else {
		out, err := podmanOutput(n.r.podman, "stop", "--time", strconv.Itoa(int(stopTimeout.Seconds())), n.name)
		require.NoError(n.t, err, "%s", out)
		out, err = podmanOutput(n.r.podman, "inspect", "--format", "{{.State.ExitCode}}", n.name)
		require.NoError(n.t, err, "%s", out)
		code, err = strconv.Atoi(strings.TrimSpace(string(out)))
		require.NoError(n.t, err, "%s", out)
	}
	n.status = &code
	return code
}

// runtimeLogin makes a login role of the runtime role, dropped when t
// ends, and returns owner (a URL) as that role.
func runtimeLogin(t *testing.T, owner string) string {
	t.Helper()
	ctx := context.Background()
	u, err := neturl.Parse(owner)
	require.NoError(t, err)
	role, password := "image_runtime_"+randomHex(4), randomHex(8)
	conn, err := pgx.Connect(ctx, owner)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE ROLE "+role+" LOGIN PASSWORD '"+password+"' IN ROLE "+migrations.RuntimeRole)
	require.NoError(t, err)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), owner)
		require.NoError(t, err)
		defer c.Close(context.Background())
		_, err = c.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
		require.NoError(t, err)
	})
	u.User = neturl.UserPassword(role, password)
	return u.String()
}

// status GETs url and returns the status (0: no answer).
func status(t *testing.T, url string) int {
	t.Helper()
	client := &http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// freeAddr returns a loopback address free when returned.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

// git runs git in the repository and returns its output, trimmed.
func git(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = repositoryRoot
	out, err := cmd.Output()
	require.NoError(t, err, "git %s", strings.Join(args, " "))
	return strings.TrimSpace(string(out))
}

// podmanOutput runs podman with args and returns its combined output.
func podmanOutput(podman string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), podmanTimeout)
	defer cancel()
	return exec.CommandContext(ctx, podman, args...).CombinedOutput()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// lastLine is the last line of out that says something.
func lastLine(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	return lines[len(lines)-1]
}
