// Package httpsec owns how the HTTP server meets its clients: who the
// client is and whether its side of the connection is HTTPS (Client, with
// ClientHTTPS and ClientAddr), the security headers every response carries
// (Headers), and the server's certificate, reloaded when its files change
// (CertReloader).
//
// X-Forwarded-Proto and X-Forwarded-For are believed only from a configured
// reverse proxy (Proxies): anyone else could write them. Handlers ask
// ClientHTTPS and ClientAddr, never the headers or r.TLS themselves.
//
// It is a leaf: it imports nothing of Tally. It never logs a certificate's
// or key's content, only the files' names.
package httpsec
