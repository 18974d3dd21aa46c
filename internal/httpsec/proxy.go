package httpsec

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// Proxies are the reverse proxies whose X-Forwarded-Proto and
// X-Forwarded-For are believed. The zero value trusts no one.
type Proxies struct {
	prefixes []netip.Prefix
}

// ParseProxies reads a comma-separated list of IP addresses and CIDR
// prefixes ("10.0.0.5, 192.168.0.0/16, fd00::/8"); an empty list trusts no
// one.
func ParseProxies(list string) (Proxies, error) {
	var p Proxies
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if strings.Contains(s, "/") {
			prefix, err := netip.ParsePrefix(s)
			if err != nil {
				return Proxies{}, fmt.Errorf("not an IP address or CIDR prefix: %q", s)
			}
			if prefix.Addr().Is4In6() {
				return Proxies{}, fmt.Errorf("an IPv4-mapped prefix: write %q in IPv4 form", s)
			}
			p.prefixes = append(p.prefixes, prefix.Masked())
			continue
		}
		addr, err := netip.ParseAddr(s)
		if err != nil || addr.Zone() != "" {
			return Proxies{}, fmt.Errorf("not an IP address or CIDR prefix: %q", s)
		}
		addr = addr.Unmap()
		p.prefixes = append(p.prefixes, netip.PrefixFrom(addr, addr.BitLen()))
	}
	return p, nil
}

// Empty reports whether p trusts no one.
func (p Proxies) Empty() bool { return len(p.prefixes) == 0 }

// Trusts reports whether addr is one of the proxies.
func (p Proxies) Trusts(addr netip.Addr) bool {
	addr = addr.Unmap().WithZone("")
	for _, prefix := range p.prefixes {
		if prefix.Contains(addr) {
			return true
		}
	}
	return false
}

// String is the list as ParseProxies reads it back.
func (p Proxies) String() string {
	parts := make([]string, len(p.prefixes))
	for i, prefix := range p.prefixes {
		if prefix.IsSingleIP() {
			parts[i] = prefix.Addr().String()
		} else {
			parts[i] = prefix.String()
		}
	}
	return strings.Join(parts, ",")
}

// client is what Client worked out about a request's client.
type client struct {
	https bool
	addr  string
}

// clientKey is the context key of a request's client.
type clientKey struct{}

// Client is middleware that works out, once per request, whether the
// client's side is HTTPS and the client's address, for ClientHTTPS and
// ClientAddr. From a peer (r.RemoteAddr) that is one of proxies, the last
// X-Forwarded-Proto value (the one that proxy wrote) says the scheme, and
// X-Forwarded-For read from the right past the proxies says the address;
// from any other peer both headers are ignored: the scheme is the
// connection's own (r.TLS) and the address the peer's.
func Client(proxies Proxies) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			c := client{https: r.TLS != nil, addr: remoteHost(r.RemoteAddr)}
			if peer, ok := parseHost(c.addr); ok && proxies.Trusts(peer) {
				if proto := lastValue(r.Header.Values("X-Forwarded-Proto")); proto != "" {
					c.https = strings.EqualFold(proto, "https")
				}
				if addr, ok := forwardedFor(r.Header.Values("X-Forwarded-For"), proxies); ok {
					c.addr = addr
				}
			}
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), clientKey{}, c)))
		})
	}
}

// ClientHTTPS reports whether the client's side of the request is HTTPS:
// as Client worked it out, or, outside Client, whether the request came
// over TLS.
func ClientHTTPS(r *http.Request) bool {
	if c, ok := r.Context().Value(clientKey{}).(client); ok {
		return c.https
	}
	return r.TLS != nil
}

// ClientAddr is the client's IP address: as Client worked it out, or,
// outside Client, the host of r.RemoteAddr.
func ClientAddr(r *http.Request) string {
	if c, ok := r.Context().Value(clientKey{}).(client); ok {
		return c.addr
	}
	return remoteHost(r.RemoteAddr)
}

// remoteHost is the host of a host:port, or the whole when it has no port.
func remoteHost(hostport string) string {
	if host, _, err := net.SplitHostPort(hostport); err == nil {
		return host
	}
	return hostport
}

// parseHost reads an IP address with or without a port.
func parseHost(s string) (netip.Addr, bool) {
	if addr, err := netip.ParseAddr(s); err == nil {
		return addr.Unmap(), true
	}
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap(), true
	}
	return netip.Addr{}, false
}

// lastValue is the last comma-separated value of a header's lines.
func lastValue(lines []string) string {
	if len(lines) == 0 {
		return ""
	}
	last := lines[len(lines)-1]
	return strings.TrimSpace(last[strings.LastIndexByte(last, ',')+1:])
}

// forwardedFor reads X-Forwarded-For from the right, where the trusted
// proxies appended, and returns the first address that is not one of them
// (or the leftmost when all are). A value that is not an address ends the
// reading: what lies left of it cannot be believed, and the peer stands.
func forwardedFor(lines []string, proxies Proxies) (string, bool) {
	var hops []string
	for _, l := range lines {
		hops = append(hops, strings.Split(l, ",")...)
	}
	found := ""
	for i := len(hops) - 1; i >= 0; i-- {
		addr, ok := parseHost(strings.TrimSpace(hops[i]))
		if !ok {
			return "", false
		}
		found = addr.String()
		if !proxies.Trusts(addr) {
			break
		}
	}
	return found, found != ""
}
