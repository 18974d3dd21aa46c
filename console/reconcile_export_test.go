package console

import (
	"net/http"

	"github.com/go-chi/chi/v5"
)

// WithReconcileActions is c's handler with the reconciliation actions
// (reconcileRoutes) in a session group in front of it: Handler serves
// them itself once console.go registers them in its session group, and
// then this is c.Handler() with the same routes first.
func WithReconcileActions(c *Console) http.Handler {
	r := chi.NewRouter()
	r.Group(func(r chi.Router) {
		r.Use(securityHeaders, c.requireSession)
		c.reconcileRoutes(r)
	})
	r.Mount("/", c.Handler())
	return r
}
