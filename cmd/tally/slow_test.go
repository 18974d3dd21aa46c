package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestSlowClientsAreCut: a client that trickles its headers, or its body,
// cannot hold a connection of `tally serve` for long — the server closes it
// after 10 s of headers (ReadHeaderTimeout) or 30 s for the whole request
// (ReadTimeout) — and oversized headers are refused. Meanwhile the node
// answers everyone else.
func TestSlowClientsAreCut(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the server's timeouts")
	}
	t.Parallel()
	n := &node{t: t, addr: freeAddr(t)}
	const admin = "slow-admin-token-0123456789abcdef"
	n.env = []string{"TALLY_DATABASE_URL=" + testdb.URL(t), "TALLY_LISTEN=" + n.addr, "TALLY_LOG_LEVEL=error", "TALLY_ADMIN_TOKEN=" + admin}
	n.start()
	defer n.stop()

	// trickle writes one byte every 500 ms after the prefix until the
	// server closes the connection, and reports how long that took.
	trickle := func(prefix, rest string) (time.Duration, error) {
		conn, err := net.Dial("tcp", n.addr)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		start := time.Now()
		if _, err := io.WriteString(conn, prefix); err != nil {
			return 0, err
		}
		closed := make(chan struct{})
		go func() {
			_, _ = io.Copy(io.Discard, conn) // returns when the server closes
			close(closed)
		}()
		for i := 0; ; i = (i + 1) % len(rest) {
			select {
			case <-closed:
				return time.Since(start), nil
			case <-time.After(500 * time.Millisecond):
			}
			if _, err := conn.Write([]byte{rest[i]}); err != nil {
				<-closed
				return time.Since(start), nil
			}
			if time.Since(start) > 45*time.Second {
				return time.Since(start), fmt.Errorf("the server kept the connection for 45 s")
			}
		}
	}

	type result struct {
		took time.Duration
		err  error
	}
	headers, body := make(chan result, 1), make(chan result, 1)
	go func() {
		d, err := trickle("GET /healthz HTTP/1.1\r\nHost: x\r\n", "X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
		headers <- result{d, err}
	}()
	go func() {
		d, err := trickle("POST /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+admin+"\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
			`{"events":[{"id":"a","tenant":"t","feature":"f","value":1}`)
		body <- result{d, err}
	}()

	// Everyone else is served meanwhile.
	for i := 0; i < 5; i++ {
		code, _ := get("http://" + n.addr + "/healthz")
		require.Equal(t, http.StatusOK, code)
		time.Sleep(200 * time.Millisecond)
	}

	// Oversized headers are refused at once.
	conn, err := net.Dial("tcp", n.addr)
	require.NoError(t, err)
	_, err = fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", strings.Repeat("a", 200<<10))
	if err == nil {
		status, rerr := bufio.NewReader(conn).ReadString('\n')
		if rerr == nil {
			require.Contains(t, status, "431")
		}
	}
	conn.Close()

	h := <-headers
	require.NoError(t, h.err)
	require.Less(t, h.took, 15*time.Second, "slow headers are cut after the 10 s header timeout")
	require.GreaterOrEqual(t, h.took, 9*time.Second)
	bd := <-body
	require.NoError(t, bd.err)
	require.Less(t, bd.took, 35*time.Second, "a slow body is cut after the 30 s read timeout")
	require.GreaterOrEqual(t, bd.took, 25*time.Second, "the handler was reading the body (an authenticated request)")
}
