package httpsec_test

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/httpsec"
)

func TestParseProxiesRefusesWhatIsNotAnAddress(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"10.0.0.300", "10.0.0.0/33", "proxy.internal", "10.0.0.1:80", "::ffff:10.0.0.0/104", "fe80::1%eth0"} {
		_, err := httpsec.ParseProxies("127.0.0.1," + bad)
		require.Error(t, err, bad)
		require.Contains(t, err.Error(), bad)
	}
}

func TestParseProxiesReadsAddressesAndPrefixes(t *testing.T) {
	t.Parallel()
	p, err := httpsec.ParseProxies(" 10.0.0.5 , 192.168.7.9/16,fd00::/8,::ffff:172.16.0.1,")
	require.NoError(t, err)
	require.Equal(t, "10.0.0.5,192.168.0.0/16,fd00::/8,172.16.0.1", p.String())
	for addr, want := range map[string]bool{
		"10.0.0.5": true, "10.0.0.6": false, "192.168.200.1": true, "192.169.0.1": false,
		"fd12::1": true, "fe80::1": false, "::ffff:10.0.0.5": true, "172.16.0.1": true,
	} {
		require.Equal(t, want, p.Trusts(netip.MustParseAddr(addr)), addr)
	}
	empty, err := httpsec.ParseProxies("")
	require.NoError(t, err)
	require.True(t, empty.Empty())
	require.False(t, empty.Trusts(netip.MustParseAddr("127.0.0.1")))
}

// seen is what a handler behind Client sees of a request.
type seen struct {
	https bool
	addr  string
}

// through sends r through Client(proxies) and returns what the handler saw.
func through(t *testing.T, proxies string, r *http.Request) seen {
	t.Helper()
	p, err := httpsec.ParseProxies(proxies)
	require.NoError(t, err)
	var s seen
	httpsec.Client(p)(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		s = seen{httpsec.ClientHTTPS(r), httpsec.ClientAddr(r)}
	})).ServeHTTP(httptest.NewRecorder(), r)
	return s
}

func request(peer string, header map[string][]string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/v1/usage", nil)
	r.RemoteAddr = peer
	for k, vs := range header {
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	return r
}

// A peer that is not a configured proxy cannot say the client side is
// HTTPS, nor who the client is: anyone can write the headers.
func TestForwardedHeadersIgnoredFromAnUntrustedPeer(t *testing.T) {
	t.Parallel()
	spoofed := map[string][]string{"X-Forwarded-Proto": {"https"}, "X-Forwarded-For": {"203.0.113.7"}}
	require.Equal(t, seen{false, "198.51.100.1"}, through(t, "10.0.0.1", request("198.51.100.1:4711", spoofed)))
	require.Equal(t, seen{false, "198.51.100.1"}, through(t, "", request("198.51.100.1:4711", spoofed)), "no proxies: nobody is believed")
	// Over direct TLS the untrusted peer cannot make the client side
	// plain either.
	r := request("198.51.100.1:4711", map[string][]string{"X-Forwarded-Proto": {"http"}})
	r.TLS = &tls.ConnectionState{}
	require.Equal(t, seen{true, "198.51.100.1"}, through(t, "10.0.0.1", r))
}

func TestForwardedProtoHonouredFromATrustedProxy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		proto []string
		want  bool
	}{
		{"https", []string{"https"}, true},
		{"upper case", []string{"HTTPS"}, true},
		{"http", []string{"http"}, false},
		{"none: the connection's own", nil, false},
		{"the proxy's value is the last", []string{"https, http"}, false},
		{"the proxy's line is the last", []string{"http", "https"}, true},
	} {
		got := through(t, "10.0.0.0/24", request("10.0.0.9:5000", map[string][]string{"X-Forwarded-Proto": tc.proto}))
		require.Equal(t, tc.want, got.https, tc.name)
	}
	r := request("10.0.0.9:5000", map[string][]string{"X-Forwarded-Proto": {"http"}})
	r.TLS = &tls.ConnectionState{}
	require.False(t, through(t, "10.0.0.0/24", r).https, "a TLS proxy hop says the client side was plain")
}

func TestForwardedForReadFromTheRightPastTheProxies(t *testing.T) {
	t.Parallel()
	const proxies = "10.0.0.0/24, 2001:db8::1"
	for _, tc := range []struct {
		name, peer string
		xff        []string
		want       string
	}{
		{"one proxy", "10.0.0.1:1", []string{"203.0.113.7"}, "203.0.113.7"},
		{"a client's own claim left of it is not believed", "10.0.0.1:1", []string{"192.0.2.66, 203.0.113.7"}, "203.0.113.7"},
		{"two proxies", "10.0.0.1:1", []string{"192.0.2.66, 203.0.113.7, 10.0.0.2"}, "203.0.113.7"},
		{"several lines", "10.0.0.1:1", []string{"192.0.2.66", "203.0.113.7", "10.0.0.2"}, "203.0.113.7"},
		{"only proxies: the leftmost", "10.0.0.1:1", []string{"10.0.0.3, 10.0.0.2"}, "10.0.0.3"},
		{"garbage: the peer stands", "10.0.0.1:1", []string{"203.0.113.7, <script>"}, "10.0.0.1"},
		{"an address with a port", "10.0.0.1:1", []string{"203.0.113.7:5555"}, "203.0.113.7"},
		{"IPv6", "[2001:db8::1]:443", []string{"2001:db8::beef"}, "2001:db8::beef"},
		{"no header: the peer", "10.0.0.1:1", nil, "10.0.0.1"},
	} {
		got := through(t, proxies, request(tc.peer, map[string][]string{"X-Forwarded-For": tc.xff}))
		require.Equal(t, tc.want, got.addr, tc.name)
	}
}

// Outside Client the helpers answer from the connection.
func TestHelpersFallBackToTheConnection(t *testing.T) {
	t.Parallel()
	r := request("192.0.2.1:999", map[string][]string{"X-Forwarded-Proto": {"https"}})
	require.False(t, httpsec.ClientHTTPS(r))
	require.Equal(t, "192.0.2.1", httpsec.ClientAddr(r))
	r.TLS = &tls.ConnectionState{}
	require.True(t, httpsec.ClientHTTPS(r))
	r.RemoteAddr = "@"
	require.Equal(t, "@", httpsec.ClientAddr(r), "a peer without a port is itself")
}
