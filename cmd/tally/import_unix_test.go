//go:build unix

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// Ctrl-C in the middle of an import: tally import reads a pipe that has
// given it two and a half batches; once the two are stored, an interrupt
// stops it at once — the half batch is not stored, the summary so far is
// printed, and it exits 1 saying where it stopped. The same rows imported
// again from a file: the rest stored, every row once.
func TestImportCtrlCStopsAfterTheStoredBatches(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	url, dir := testdb.URLOf(t, pool), t.TempDir()
	fifo := filepath.Join(dir, "stream.jsonl")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	var rows strings.Builder
	for i := 0; i < 250; i++ {
		fmt.Fprintf(&rows, `{"id":"e%d","tenant":"acme","feature":"api","value":1,"timestamp":%q}`+"\n", i, importTS)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out, errs bytes.Buffer
	cmd := exec.CommandContext(ctx, binary, "import", "--batch", "100", fifo)
	cmd.Env = append(os.Environ(), "TALLY_DATABASE_URL="+url)
	cmd.Stdout, cmd.Stderr = &out, &errs
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	// The pipe opens for writing once tally import opens it for reading.
	var w *os.File
	require.Eventually(t, func() bool {
		f, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0)
		w = f
		return err == nil
	}, 30*time.Second, 20*time.Millisecond, "tally import never opened the pipe")
	defer w.Close()
	_, err := w.WriteString(rows.String())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(importLedger(t, pool)) == 200 }, 30*time.Second, 20*time.Millisecond)

	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	var ee *exec.ExitError
	select {
	case err := <-exited:
		require.ErrorAs(t, err, &ee, "stdout:\n%s\nstderr:\n%s", &out, &errs)
	case <-time.After(30 * time.Second):
		t.Fatalf("tally import did not stop on the interrupt; stderr:\n%s", &errs)
	}
	require.Equal(t, 1, ee.ExitCode())
	require.Contains(t, errs.String(), fmt.Sprintf("interrupted after %s line 200: run the same command again to resume", fifo))
	require.Equal(t, "200", importSummary(t, out.String(), "accepted"))
	require.Equal(t, "200", importSummary(t, out.String(), "rows read"))
	require.Len(t, importLedger(t, pool), 200, "the half batch was not stored")

	file := importWriteFile(t, dir, "again.jsonl", rows.String())
	code, again, stderr := tally(t, url, "import", "--batch", "100", file)
	require.Equal(t, 0, code, stderr)
	require.Equal(t, "50", importSummary(t, again, "accepted"))
	require.Equal(t, "200", importSummary(t, again, "duplicates"))
	require.Len(t, importLedger(t, pool), 250)
}

// noteReport is an import's report that passes on its notes.
type noteReport struct{ notes chan string }

func (r noteReport) badRows(string, []badRow) {}
func (r noteReport) progress(importStats)     {}
func (r noteReport) note(msg string)          { r.notes <- msg }
func (r noteReport) done(importStats, bool)   {}

// After the first interrupt (the import's context ends), a second one
// abandons the batch in flight: it ends the transactions' context.
func TestImportSecondInterruptAbandonsTheBatchInFlight(t *testing.T) {
	t.Parallel()
	ctx, interrupt := context.WithCancel(context.Background())
	work, abandon := context.WithCancel(context.Background())
	defer abandon()
	report := noteReport{notes: make(chan string, 1)}
	stop := abandonOnSecondInterrupt(ctx, abandon, report)
	defer stop()
	require.NoError(t, work.Err())
	interrupt()
	select {
	case msg := <-report.notes:
		require.Contains(t, msg, "interrupt again to abandon it")
	case <-time.After(10 * time.Second):
		t.Fatal("no note of the first interrupt")
	}
	require.NoError(t, work.Err(), "the first interrupt lets the batch in flight finish")
	// The watcher listens for interrupts now: this one goes to it, not to
	// the test process's default handling.
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGINT))
	select {
	case <-work.Done():
		require.True(t, errors.Is(work.Err(), context.Canceled))
	case <-time.After(10 * time.Second):
		t.Fatal("the second interrupt did not abandon the batch in flight")
	}
}
