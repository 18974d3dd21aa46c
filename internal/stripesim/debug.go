package stripesim

import (
	"encoding/json"
	"net/http"
	"strings"
)

// debugPrefix is where the simulator shows what it recorded, for people
// trying Tally out (tally dev prints the address). It is not a Stripe
// endpoint and needs no key.
const debugPrefix = "/_sim/"

// withDebug serves GET /_sim/events?account=… (the recorded meter events of
// an account, the default one when none is given) beside next.
func (s *Server) withDebug(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, debugPrefix) {
			next.ServeHTTP(w, r)
			return
		}
		if r.Method != http.MethodGet || r.URL.Path != debugPrefix+"events" {
			http.NotFound(w, r)
			return
		}
		account := r.URL.Query().Get("account")
		if account == "" {
			account = DefaultAccount
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(map[string]any{"account": account, "events": s.Events(account)})
	})
}
