package httpsec

import "net/http"

// The security headers of every response.
const (
	// HSTS is Strict-Transport-Security, sent only when the client's side
	// is HTTPS: a year, without includeSubDomains (Tally cannot speak for
	// the other hosts of its domain) and without preload.
	HSTS = "max-age=31536000"
	// ContentSecurityPolicy is the default policy: nothing loads, nothing
	// frames. A handler serving pages sets its own (the console does).
	ContentSecurityPolicy = "default-src 'none'; frame-ancestors 'none'"
	// ReferrerPolicy keeps URLs from leaving the origin; it is not
	// no-referrer, under which browsers send "Origin: null" with a form's
	// POST and an Origin check could not tell a same-origin sign-in.
	ReferrerPolicy = "same-origin"
)

// Headers is middleware that sets the security headers on every response:
// X-Content-Type-Options nosniff, X-Frame-Options DENY, Referrer-Policy,
// a default Content-Security-Policy that handlers may replace, and HSTS
// when ClientHTTPS (so put it inside Client).
func Headers(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", ReferrerPolicy)
		h.Set("Content-Security-Policy", ContentSecurityPolicy)
		if ClientHTTPS(r) {
			h.Set("Strict-Transport-Security", HSTS)
		}
		next.ServeHTTP(w, r)
	})
}
