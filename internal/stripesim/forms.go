package stripesim

import (
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// checkParamPatterns rejects form keys that match none of patterns
// (anchored), like checkParams does with exact names: the billing endpoints
// take indexed and nested keys (tiers[0][up_to], metadata[any]).
func checkParamPatterns(form url.Values, patterns ...*regexp.Regexp) *apiError {
	keys := make([]string, 0, len(form))
	for k := range form {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if k == "expand" || strings.HasPrefix(k, "expand[") {
			continue
		}
		if !slices.ContainsFunc(patterns, func(p *regexp.Regexp) bool { return p.MatchString(k) }) {
			return errUnknownParam(k)
		}
	}
	return nil
}

// exact is a pattern matching one literal key.
func exact(key string) *regexp.Regexp { return regexp.MustCompile("^" + regexp.QuoteMeta(key) + "$") }

// metadataKey matches metadata[any key].
var metadataKey = regexp.MustCompile(`^metadata\[[^\]]+\]$`)

// indexedEntry is one element of an indexed form array such as
// items[2][price]: its index and its fields, keyed by what follows the
// index ("price", "metadata[k]").
type indexedEntry struct {
	index  int
	fields url.Values
}

// indexedParams collects name[N][field] keys of form into entries sorted
// by N. A key name[N] without a field, or an index that is not a
// non-negative integer, is refused as an unknown parameter.
func indexedParams(form url.Values, name string) ([]indexedEntry, *apiError) {
	byIndex := map[int]url.Values{}
	for k, vs := range form {
		rest, ok := strings.CutPrefix(k, name+"[")
		if !ok {
			continue
		}
		idx, after, ok := strings.Cut(rest, "]")
		n, err := strconv.Atoi(idx)
		if !ok || err != nil || n < 0 || !strings.HasPrefix(after, "[") || !strings.HasSuffix(after, "]") {
			return nil, errUnknownParam(k)
		}
		inner := after[1:]
		field := strings.TrimSuffix(inner, "]")
		if i := strings.Index(inner, "]["); i >= 0 {
			field = inner[:i] + "[" + inner[i+2:]
		}
		if byIndex[n] == nil {
			byIndex[n] = url.Values{}
		}
		byIndex[n][field] = vs
	}
	out := make([]indexedEntry, 0, len(byIndex))
	for n, f := range byIndex {
		out = append(out, indexedEntry{index: n, fields: f})
	}
	slices.SortFunc(out, func(a, b indexedEntry) int { return a.index - b.index })
	return out, nil
}

// nestedMap returns the values of name[k] keys of form, by k.
func nestedMap(form url.Values, name string) map[string]string {
	out := map[string]string{}
	for k, vs := range form {
		if inner, ok := strings.CutPrefix(k, name+"["); ok && strings.HasSuffix(inner, "]") && !strings.Contains(inner, "[") {
			out[strings.TrimSuffix(inner, "]")] = vs[0]
		}
	}
	return out
}

// boolParam reads the boolean form value name ("true" or "false"); absent
// is def.
func boolParam(f url.Values, name string, def bool) (bool, *apiError) {
	if !f.Has(name) {
		return def, nil
	}
	switch v := f.Get(name); v {
	case "true":
		return true, nil
	case "false":
		return false, nil
	default:
		return false, errValidation("parameter_invalid_boolean", name, "Invalid boolean: %s", v)
	}
}

// optionalInt reads the integer form value name, if present.
func optionalInt(f url.Values, name string) (int64, bool, *apiError) {
	if !f.Has(name) {
		return 0, false, nil
	}
	n, e := intParam(f, name)
	return n, true, e
}

// createdFilter is a created (or other timestamp) filter of a list
// endpoint: created=<unix> or created[gt|gte|lt|lte]=<unix>.
type createdFilter struct {
	eq, gt, gte, lt, lte *int64
}

// parseCreatedFilter reads the filter name of form.
func parseCreatedFilter(form url.Values, name string) (createdFilter, *apiError) {
	var c createdFilter
	for k := range form {
		var to **int64
		switch k {
		case name:
			to = &c.eq
		case name + "[gt]":
			to = &c.gt
		case name + "[gte]":
			to = &c.gte
		case name + "[lt]":
			to = &c.lt
		case name + "[lte]":
			to = &c.lte
		default:
			continue
		}
		n, e := intParam(form, k)
		if e != nil {
			return c, e
		}
		*to = &n
	}
	return c, nil
}

// keeps reports whether t passes the filter, to the second.
func (c createdFilter) keeps(t time.Time) bool {
	u := t.Unix()
	switch {
	case c.eq != nil && u != *c.eq,
		c.gt != nil && u <= *c.gt,
		c.gte != nil && u < *c.gte,
		c.lt != nil && u >= *c.lt,
		c.lte != nil && u > *c.lte:
		return false
	}
	return true
}

// createdKeys are the keys a created filter may use.
var createdKeys = []*regexp.Regexp{exact("created"), regexp.MustCompile(`^created\[(gt|gte|lt|lte)\]$`)}

// listKeys are the cursor parameters of every list endpoint.
var listKeys = []*regexp.Regexp{exact("limit"), exact("starting_after"), exact("ending_before")}

// expands reports whether the request's expand parameters (expand[]=…,
// expand[0]=… or expand=…) name a path ending in field, as
// "items.data.price.tiers" or "tiers" both do for "tiers".
func expands(form url.Values, field string) bool {
	for k, vs := range form {
		if k != "expand" && !strings.HasPrefix(k, "expand[") {
			continue
		}
		for _, v := range vs {
			if v == field || strings.HasSuffix(v, "."+field) {
				return true
			}
		}
	}
	return false
}
