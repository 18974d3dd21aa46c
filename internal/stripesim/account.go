package stripesim

import "net/http"

// accountJSON is the account object, with the fields stripe-go's
// stripe.Account decodes that a simulated account can fill.
type accountJSON struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Type             string            `json:"type"`
	Country          string            `json:"country"`
	DefaultCurrency  string            `json:"default_currency"`
	Created          int64             `json:"created"`
	ChargesEnabled   bool              `json:"charges_enabled"`
	PayoutsEnabled   bool              `json:"payouts_enabled"`
	DetailsSubmitted bool              `json:"details_submitted"`
	Email            *string           `json:"email"`
	Metadata         map[string]string `json:"metadata"`
}

// getAccount is GET /v1/account: the account the request acts on.
func (s *Server) getAccount(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c := callerOf(r)
	s.mu.Lock()
	a := s.accountLocked(c.account)
	out := accountJSON{
		ID: a.id, Object: "account", Type: "standard", Country: "US", DefaultCurrency: "usd",
		Created: a.created.Unix(), ChargesEnabled: true, PayoutsEnabled: true, DetailsSubmitted: true,
		Metadata: map[string]string{},
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}
