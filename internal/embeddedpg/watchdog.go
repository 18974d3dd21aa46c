package embeddedpg

import (
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

// watchdogScript is the watchdog's program, run by /bin/sh with the
// postmaster's pid, its postmaster.pid file and a number of 100 ms ticks as
// $1, $2 and $3. Its standard input is a pipe whose only writer is tally. A
// line on it means tally saw the postmaster exit: the watchdog exits. End of
// file without a line means tally died without stopping the server: the
// watchdog asks for a fast shutdown (SIGINT), then an immediate one (SIGQUIT)
// after $3 ticks, and kills the server's process group after $3 more. Before
// every signal it checks that postmaster.pid still names the pid (the server
// writes the file before it accepts connections and removes it when it
// exits), so that a recycled pid is never signalled. It ignores the hang-up
// and interrupt signals a terminal sends, which are tally's to handle.
const watchdogScript = `trap '' HUP INT
if read -r _; then exit 0; fi
ours() {
	[ -r "$2" ] || return 1
	IFS= read -r named < "$2" || return 1
	[ "$named" = "$1" ]
}
ours "$1" "$2" || exit 0
echo "embeddedpg watchdog: tally exited without stopping postgres; stopping postgres (pid $1)" >&2
kill -s INT "$1" 2>/dev/null || exit 0
n=0
while kill -s 0 "$1" 2>/dev/null; do
	n=$((n + 1))
	ours "$1" "$2" || exit 0
	if [ "$n" -eq "$3" ]; then kill -s QUIT "$1" 2>/dev/null; fi
	if [ "$n" -ge $(($3 * 2)) ]; then kill -s KILL -- "-$1" 2>/dev/null; exit 0; fi
	sleep 0.1
done
`

// watchdogTick is the watchdog's polling interval, as the script's sleep
// says it.
const watchdogTick = 100 * time.Millisecond

// watchdog is a small child process that stops the postmaster when tally
// dies without stopping it, on systems without a parent-death signal
// (macOS). It watches a pipe rather than tally's pid: the kernel closes the
// pipe when tally dies, however it dies.
type watchdog struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser // the pipe's write end, held by tally alone
}

// startWatchdog starts the watchdog of the postmaster pid, whose pid file is
// pidFile, as the user as (so that it may signal the server and read its pid
// file, and holds no more privilege than the server). Its messages go to
// stderr, the server's log.
func startWatchdog(pid int, pidFile string, as *runAs, stderr io.Writer) (*watchdog, error) {
	ticks := int(killGrace / watchdogTick)
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "embeddedpg-watchdog",
		strconv.Itoa(pid), pidFile, strconv.Itoa(ticks))
	cmd.Dir = "/"
	cmd.Env = childEnv(as)
	cmd.Stderr = stderr
	cmd.SysProcAttr = sysProcAttr(as, syscall.Signal(0))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: watchdog pipe: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("embeddedpg: start watchdog: %w", err)
	}
	return &watchdog{cmd: cmd, stdin: stdin}, nil
}

// release tells the watchdog that the postmaster has exited, so that it
// exits without signalling anything, and waits for it. A nil watchdog does
// nothing.
func (w *watchdog) release() {
	if w == nil {
		return
	}
	_, _ = io.WriteString(w.stdin, "postmaster exited\n")
	_ = w.stdin.Close()
	_ = w.cmd.Wait()
}
