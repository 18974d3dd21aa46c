package stripesim

import (
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
)

const customerObjectName = "customer"

// customer is a customer as the simulator holds it.
type customer struct {
	id          string
	livemode    bool
	created     time.Time
	name        string
	email       string
	description string
	phone       string
	metadata    map[string]string
	// deleted: DELETE /v1/customers/{id} removed it; its id still
	// answers, with deleted: true.
	deleted bool
}

// customerJSON is the customer object, with the fields stripe-go's
// stripe.Customer decodes that a simulated customer can fill.
type customerJSON struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Balance          int64             `json:"balance"`
	Created          int64             `json:"created"`
	Currency         *string           `json:"currency"`
	Delinquent       bool              `json:"delinquent"`
	Description      *string           `json:"description"`
	Email            *string           `json:"email"`
	InvoicePrefix    string            `json:"invoice_prefix"`
	Livemode         bool              `json:"livemode"`
	Metadata         map[string]string `json:"metadata"`
	Name             *string           `json:"name"`
	Phone            *string           `json:"phone"`
	PreferredLocales []string          `json:"preferred_locales"`
	TaxExempt        string            `json:"tax_exempt"`
}

func optional(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func (c *customer) json() customerJSON {
	md := make(map[string]string, len(c.metadata))
	for k, v := range c.metadata {
		md[k] = v
	}
	return customerJSON{
		ID: c.id, Object: "customer", Created: c.created.Unix(), Livemode: c.livemode,
		Description: optional(c.description), Email: optional(c.email), Name: optional(c.name),
		Phone: optional(c.phone), Metadata: md, PreferredLocales: []string{}, TaxExempt: "none",
		InvoicePrefix: invoicePrefix(c.id),
	}
}

// invoicePrefix derives a stable invoice prefix from a customer id.
func invoicePrefix(id string) string {
	id = strings.TrimPrefix(id, "cus_")
	if len(id) > 8 {
		id = id[len(id)-8:]
	}
	return strings.ToUpper(id)
}

// newCustomerID returns a fresh cus_ id.
func newCustomerID() string { return randomID("cus_", 14) }

// CreateCustomer adds a customer with the given id (a fresh cus_ id when
// empty) to account (added if unknown), in both modes, without HTTP: tests
// and demo data use fixed ids such as cus_acme. It is a no-op for an id the
// account already has. It returns the id.
func (s *Server) CreateCustomer(account, id string) string {
	if id == "" {
		id = newCustomerID()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accountLocked(account)
	for _, live := range []bool{false, true} {
		k := modeID{live, id}
		if a.customers[k] == nil {
			a.customers[k] = &customer{id: id, livemode: live, created: s.now(), metadata: map[string]string{}}
		}
	}
	return id
}

// createCustomer is POST /v1/customers. It keeps name, email, description,
// phone and metadata; other parameters are refused as unknown.
func (s *Server) createCustomer(w http.ResponseWriter, r *http.Request) {
	rest, md := splitNested(r.Form, "metadata")
	if e := checkParams(rest, "name", "email", "description", "phone"); e != nil {
		writeError(w, e)
		return
	}
	c := callerOf(r)
	f := r.Form
	cu := &customer{
		id: newCustomerID(), livemode: c.livemode, created: s.now(),
		name: f.Get("name"), email: f.Get("email"), description: f.Get("description"),
		phone: f.Get("phone"), metadata: md,
	}
	s.mu.Lock()
	s.accountLocked(c.account).customers[modeID{c.livemode, cu.id}] = cu
	out := cu.json()
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}

// updateCustomer is POST /v1/customers/{id}: it sets the name, email,
// description and phone given ("" unsets one, as Stripe takes an empty
// string for a nullable field) and merges metadata; other parameters are
// refused as unknown. An unknown or deleted id is 404 resource_missing.
func (s *Server) updateCustomer(w http.ResponseWriter, r *http.Request) {
	rest, md := splitNested(r.Form, "metadata")
	if e := checkParams(rest, "name", "email", "description", "phone"); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	cu := s.accountLocked(c.account).customers[modeID{c.livemode, id}]
	var out customerJSON
	found := cu != nil && !cu.deleted
	if found {
		for k, to := range map[string]*string{"name": &cu.name, "email": &cu.email, "description": &cu.description, "phone": &cu.phone} {
			if _, ok := rest[k]; ok {
				*to = rest.Get(k)
			}
		}
		for k, v := range md {
			cu.metadata[k] = v
		}
		out = cu.json()
	}
	s.mu.Unlock()
	if !found {
		writeError(w, errNoSuch(http.StatusNotFound, customerObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// deletedCustomerJSON is a deleted customer as Stripe answers it: "a
// subset of the customer's information ... including a deleted property
// that's set to true" (https://docs.stripe.com/api/customers/retrieve); the
// subset is the deleted_customer object's id, object and deleted
// (https://docs.stripe.com/api/customers/delete).
type deletedCustomerJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Deleted bool   `json:"deleted"`
}

// getCustomer is GET /v1/customers/{id}: the customer; a deleted one as
// {id, object, deleted: true}; an unknown id 404 resource_missing.
func (s *Server) getCustomer(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	cu := s.accountLocked(c.account).customers[modeID{c.livemode, id}]
	var out any
	switch {
	case cu == nil:
	case cu.deleted:
		out = deletedCustomerJSON{ID: cu.id, Object: customerObjectName, Deleted: true}
	default:
		out = cu.json()
	}
	s.mu.Unlock()
	if cu == nil {
		writeError(w, errNoSuch(http.StatusNotFound, customerObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteCustomer is DELETE /v1/customers/{id}: the customer is deleted and
// answered as {id, object, deleted: true}; an id the account does not have,
// or has deleted already, is 404 resource_missing (deleting twice: not
// verified, the simulator treats a deleted customer as gone).
func (s *Server) deleteCustomer(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	cu := s.accountLocked(c.account).customers[modeID{c.livemode, id}]
	found := cu != nil && !cu.deleted
	if found {
		cu.deleted = true
	}
	s.mu.Unlock()
	if !found {
		writeError(w, errNoSuch(http.StatusNotFound, customerObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, deletedCustomerJSON{ID: id, Object: customerObjectName, Deleted: true})
}

// splitNested separates the keys name[...] of form (one level, as
// payload[value]) from the rest. It returns the rest and the nested map.
func splitNested(form url.Values, name string) (url.Values, map[string]string) {
	rest := url.Values{}
	nested := map[string]string{}
	for k, vs := range form {
		if inner, ok := strings.CutPrefix(k, name+"["); ok && strings.HasSuffix(inner, "]") && len(inner) > 1 {
			nested[strings.TrimSuffix(inner, "]")] = vs[0]
			continue
		}
		rest[k] = vs
	}
	return rest, nested
}
