package stripesim

import (
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// listEnvelope is Stripe's list object.
type listEnvelope struct {
	Object  string `json:"object"`
	Data    any    `json:"data"`
	HasMore bool   `json:"has_more"`
	URL     string `json:"url"`
}

// listParams are the cursor parameters every Stripe list endpoint takes:
// limit, starting_after and ending_before.
type listParams struct {
	limit         int
	startingAfter string
	endingBefore  string
}

func parseListParams(form url.Values) (listParams, *apiError) {
	p := listParams{limit: 10, startingAfter: form.Get("starting_after"), endingBefore: form.Get("ending_before")}
	if v := form.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return p, errValidation("parameter_invalid_integer", "limit", "Invalid integer: %s", v)
		}
		if n < 1 || n > 100 {
			return p, errValidation("", "limit", "Invalid limit: must be between 1 and 100")
		}
		p.limit = n
	}
	if p.startingAfter != "" && p.endingBefore != "" {
		return p, errValidation("parameters_exclusive", "ending_before",
			"You may only specify one of these parameters: starting_after, ending_before.")
	}
	return p, nil
}

// paginate returns one page of items, which are in list order (newest
// first). The cursor is found among all items; keep then filters. With
// ending_before the page is the items just before the cursor, still in list
// order, and has_more says whether there are more before them.
func paginate[T any](items []T, id func(T) string, keep func(T) bool, p listParams, object string) ([]T, bool, *apiError) {
	lo, hi := 0, len(items) // the window [lo, hi) the page is taken from
	if cur := p.startingAfter + p.endingBefore; cur != "" {
		idx := -1
		for i, it := range items {
			if id(it) == cur {
				idx = i
				break
			}
		}
		param := "starting_after"
		if p.endingBefore != "" {
			param = "ending_before"
		}
		if idx < 0 {
			return nil, false, errNoSuch(http.StatusBadRequest, object, param, cur)
		}
		if p.startingAfter != "" {
			lo = idx + 1
		} else {
			hi = idx
		}
	}
	var cand []T
	for _, it := range items[lo:hi] {
		if keep(it) {
			cand = append(cand, it)
		}
	}
	if len(cand) <= p.limit {
		return cand, false, nil
	}
	if p.endingBefore != "" {
		return cand[len(cand)-p.limit:], true, nil
	}
	return cand[:p.limit], true, nil
}

// checkParams rejects form keys outside allowed (exact names, nested keys
// written out: "customer_mapping[type]"), like Stripe's "Received unknown
// parameter". expand, in any form, is always allowed.
func checkParams(form url.Values, allowed ...string) *apiError {
	keys := make([]string, 0, len(form))
	for k := range form {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if k != "expand" && !strings.HasPrefix(k, "expand[") && !slices.Contains(allowed, k) {
			return errUnknownParam(k)
		}
	}
	return nil
}
