// Package openapitest checks HTTP exchanges with Tally's /v1 API against
// its OpenAPI document (api/openapi.json) with libopenapi-validator: the
// api package's tests and the end-to-end tests pass every request and
// answer they make through a Checker, so the document cannot drift from
// what the server does.
//
// It owns that check and the reading of the document's operations (the
// route, the role, the error codes of each answer). It is for tests only:
// production code never imports it, which would link the validator into
// the binary. It never sends a request, and its errors never quote a
// header's value (tokens travel in them).
package openapitest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/pb33f/libopenapi"
	validator "github.com/pb33f/libopenapi-validator"
	"github.com/pb33f/libopenapi-validator/config"
	verrors "github.com/pb33f/libopenapi-validator/errors"
	"github.com/pb33f/libopenapi-validator/schema_validation"
	"github.com/pb33f/libopenapi/datamodel/high/base"

	"github.com/tallymeter/tally/api"
)

// Operation is one operation of the document.
type Operation struct {
	// Method is upper case (GET); Path is the template, e.g.
	// /v1/outbox/items/{id}, spelt as chi spells the route.
	Method, Path string
	// Role is the least token role the operation needs (x-tally-role):
	// ingest, finance, operator, admin, or none.
	Role string
}

// rawOperation is what Check reads of an operation besides the validator.
type rawOperation struct {
	Operation
	// codes are the error codes each status may answer (x-error-codes).
	codes map[int][]string
}

// Checker checks exchanges against one document. It is safe for
// concurrent use.
type Checker struct {
	validator   validator.Validator
	schemas     schema_validation.SchemaValidator
	errorSchema *base.Schema
	ops         []rawOperation
	// unroutedCodes are the error codes of unrouted's answers.
	unroutedCodes map[int][]string
}

// unrouted names the document's answers (components.responses) to a
// request no operation takes: an unknown /v1 route answers 401 before 404
// or 405.
var unrouted = map[int]string{
	http.StatusUnauthorized:     "Unauthorized",
	http.StatusNotFound:         "UnknownRoute",
	http.StatusMethodNotAllowed: "MethodNotAllowed",
}

// New reads an OpenAPI 3.1 document and returns a Checker of it. The
// validator asserts formats (date-time) and runs in strict mode: a
// property or header the document does not declare is a mismatch even
// where a schema does not forbid more, so that an answer that grew a field
// fails until the document says so.
func New(document []byte) (*Checker, error) {
	doc, err := libopenapi.NewDocument(document)
	if err != nil {
		return nil, fmt.Errorf("openapitest: reading the document: %w", err)
	}
	model, err := doc.BuildV3Model()
	if err != nil {
		return nil, fmt.Errorf("openapitest: building the document's model: %w", err)
	}
	v, errs := validator.NewValidator(doc,
		config.WithFormatAssertions(),
		config.WithStrictMode(),
		// Headers every answer carries that no client reads as data:
		// internal/httpsec's security headers.
		config.WithStrictIgnoredHeadersExtra("X-Content-Type-Options", "X-Frame-Options", "Referrer-Policy",
			"Content-Security-Policy", "Strict-Transport-Security"),
		config.WithStrictIgnorePaths(
			// An audit entry's details are free-form by design.
			"$.body.entries[*].details.**", "$.body.audit[*].details.**",
			// A Stripe v1 event's snapshot of its object: Stripe's, not
			// Tally's; only its envelope is read.
			"$.body.data.object.**",
			// GET /v1/openapi.json: the parts of an OpenAPI document,
			// which ValidateDocument checks against OpenAPI's own schema.
			// (** is any depth, brackets included: paths['/v1/usage']).
			"$.body.info**", "$.body.servers**", "$.body.paths**", "$.body.webhooks**",
			"$.body.components**", "$.body.security**", "$.body.tags**", "$.body.externalDocs**"),
		config.WithCustomFormat("int64", int64Format),
	)
	if len(errs) > 0 {
		return nil, fmt.Errorf("openapitest: building the validator: %w", errors.Join(errs...))
	}
	var errorSchema *base.Schema
	if model.Model.Components != nil && model.Model.Components.Schemas != nil {
		if p := model.Model.Components.Schemas.GetOrZero("Error"); p != nil {
			errorSchema = p.Schema()
		}
	}
	if errorSchema == nil {
		return nil, errors.New("openapitest: the document has no components.schemas.Error")
	}
	ops, unroutedCodes, err := operations(document)
	if err != nil {
		return nil, err
	}
	return &Checker{validator: v, schemas: schema_validation.NewSchemaValidator(), errorSchema: errorSchema, ops: ops,
		unroutedCodes: unroutedCodes}, nil
}

// Default is the Checker of the document the api package serves
// (api.OpenAPI), made once.
var Default = sync.OnceValues(func() (*Checker, error) { return New(api.OpenAPI()) })

// Operations lists the document's operations, by path and method.
func (c *Checker) Operations() []Operation {
	out := make([]Operation, len(c.ops))
	for i, o := range c.ops {
		out[i] = o.Operation
	}
	return out
}

// ValidateDocument checks the document against the OpenAPI 3.1
// specification's schema.
func (c *Checker) ValidateDocument() error {
	ok, errs := c.validator.ValidateDocument()
	if ok {
		return nil
	}
	return fmt.Errorf("openapitest: the document is not valid OpenAPI:\n%s", describe(errs))
}

// Check checks one exchange: req, sent with reqBody, and its answer resp,
// read as respBody (resp.Body is not read). It returns nil when they match
// the document, else an error naming the route, the status and the
// validator's reasons. Only /v1 paths are checked.
//
//   - The answer is always checked: its status must be documented for the
//     operation, its headers and body must match, and an error's code must
//     be one the answer lists (x-error-codes).
//   - The request is checked when the server took it (1xx to 3xx): a
//     request the server took and the document refuses means the document
//     is stricter than the server. A refused request proves nothing: tests
//     send bad ones on purpose, and the server refuses some the document
//     cannot describe (a timestamp too far ahead).
//   - A request to no operation of the document must be answered 401, 404
//     or 405 with the error shape: the router check (every route
//     documented) is the api package's test.
//
// A body sent without a Content-Type is checked as JSON: the server reads
// every body as JSON whatever its Content-Type.
func (c *Checker) Check(req *http.Request, reqBody []byte, resp *http.Response, respBody []byte) error {
	if req == nil || req.URL == nil || resp == nil {
		return errors.New("openapitest: Check needs a request and its answer")
	}
	path := req.URL.Path
	if !strings.HasPrefix(path, "/v1/") {
		return nil
	}
	where := fmt.Sprintf("%s %s answered %d", req.Method, path, resp.StatusCode)
	op, ok := c.find(req.Method, path)
	if !ok {
		if _, ok := unrouted[resp.StatusCode]; !ok {
			return fmt.Errorf("openapitest: %s, but the document has no %s operation for this path: document it", where, req.Method)
		}
		if valid, errs := c.schemas.ValidateSchemaBytesWithVersion(c.errorSchema, respBody, 3.1); !valid {
			return fmt.Errorf("openapitest: %s, not the error shape:\n%s", where, describe(errs))
		}
		unknown := rawOperation{codes: c.unroutedCodes}
		if msg := unknown.checkCode(resp.StatusCode, respBody); msg != "" {
			return fmt.Errorf("openapitest: %s, a path or method no operation has: %s (components.responses.%s)", where, msg, unrouted[resp.StatusCode])
		}
		return nil
	}
	where = fmt.Sprintf("%s %s (%s %s) answered %d", req.Method, path, op.Method, op.Path, resp.StatusCode)
	var problems []string
	if valid, errs := c.validator.ValidateHttpResponse(requestOf(req, reqBody), responseOf(resp, respBody)); !valid {
		problems = append(problems, "the answer:\n"+describe(errs))
	}
	if resp.StatusCode >= 400 {
		if msg := op.checkCode(resp.StatusCode, respBody); msg != "" {
			problems = append(problems, msg)
		}
	}
	if resp.StatusCode < 400 {
		if valid, errs := c.validator.ValidateHttpRequestSync(requestOf(req, reqBody)); !valid {
			problems = append(problems, "the request, which the server took:\n"+describe(errs))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("openapitest: %s, which the document (api/openapi.json) does not describe:\n%s", where, strings.Join(problems, "\n"))
	}
	return nil
}

// checkCode says what is wrong with an error answer's code: nothing ("")
// when it is one the answer lists.
func (o rawOperation) checkCode(status int, body []byte) string {
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) != nil || e.Error.Code == "" {
		return "" // the validator said what is wrong with the body
	}
	codes, ok := o.codes[status]
	if !ok {
		return fmt.Sprintf("the document lists no error codes (x-error-codes) for %d", status)
	}
	if !slices.Contains(codes, e.Error.Code) {
		return fmt.Sprintf("error code %q is not one the document lists for %d: %s", e.Error.Code, status, strings.Join(codes, ", "))
	}
	return ""
}

// find returns the operation of method and path: a template's literal
// segments win over its parameters, as in chi.
func (c *Checker) find(method, path string) (rawOperation, bool) {
	segs := strings.Split(path, "/")
	best, bestScore := -1, -1
	for i, o := range c.ops {
		if o.Method != method {
			continue
		}
		tmpl := strings.Split(o.Path, "/")
		if len(tmpl) != len(segs) {
			continue
		}
		score := 0
		for j, t := range tmpl {
			switch {
			case strings.HasPrefix(t, "{") && strings.HasSuffix(t, "}") && segs[j] != "":
			case t == segs[j]:
				score++
			default:
				score = -1
			}
			if score < 0 {
				break
			}
		}
		if score > bestScore {
			best, bestScore = i, score
		}
	}
	if best < 0 {
		return rawOperation{}, false
	}
	return c.ops[best], true
}

// int64Format is the int64 format as the validator can check it: it turns
// every JSON number into a float64 (content.Canonicalize), where 2^63-1
// reads as 2^63, which its own int64 format then refuses (v0.16.2). A
// whole number from -2^63 to 2^63 passes, one beyond fails; exactly 2^63
// cannot be told from 2^63-1, and the server refuses it (a refused
// request is not checked).
func int64Format(v any) error {
	var f float64
	switch n := v.(type) {
	case float64:
		f = n
	case json.Number:
		if _, err := n.Int64(); err == nil {
			return nil
		}
		var err error
		if f, err = n.Float64(); err != nil {
			return fmt.Errorf("%s is not a number", n)
		}
	default:
		return nil // not a number: the type says what is wrong
	}
	if f != math.Trunc(f) || f < -(1<<63) || f > 1<<63 {
		return fmt.Errorf("must be a whole number from %d to %d", math.MinInt64, math.MaxInt64)
	}
	return nil
}

// requestOf is a copy of req to validate, with body.
func requestOf(req *http.Request, body []byte) *http.Request {
	r := req.Clone(req.Context())
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	if len(body) > 0 && r.Header.Get("Content-Type") == "" {
		r.Header.Set("Content-Type", "application/json")
	}
	return r
}

// responseOf is a copy of resp to validate, with body.
func responseOf(resp *http.Response, body []byte) *http.Response {
	r := *resp
	r.Header = resp.Header.Clone()
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	return &r
}

// maxReasons bounds the reasons an error lists.
const maxReasons = 12

// describe lists the validator's reasons: what failed and, for a schema,
// where in the body and why.
func describe(errs []*verrors.ValidationError) string {
	var lines []string
	for _, e := range errs {
		line := "  - " + e.Message
		if e.Reason != "" && e.Reason != e.Message {
			line += ": " + e.Reason
		}
		lines = append(lines, line)
		for _, s := range e.SchemaValidationErrors {
			at := s.FieldPath
			if at == "" {
				at = s.KeywordLocation
			}
			lines = append(lines, "      "+at+": "+s.Reason)
		}
	}
	if len(lines) > maxReasons {
		lines = append(lines[:maxReasons], fmt.Sprintf("  … and %d more", len(lines)-maxReasons))
	}
	return strings.Join(lines, "\n")
}

// operations reads the document's operations with their roles and error
// codes, following the $refs of components.responses, and the codes of
// the answers to a request no operation takes (unrouted).
func operations(document []byte) ([]rawOperation, map[int][]string, error) {
	var doc struct {
		Paths      map[string]map[string]json.RawMessage `json:"paths"`
		Components struct {
			Responses map[string]json.RawMessage `json:"responses"`
		} `json:"components"`
	}
	if err := json.Unmarshal(document, &doc); err != nil {
		return nil, nil, fmt.Errorf("openapitest: reading the document: %w", err)
	}
	type response struct {
		Ref   string   `json:"$ref"`
		Codes []string `json:"x-error-codes"`
	}
	codesOf := func(raw json.RawMessage) ([]string, error) {
		var r response
		if err := json.Unmarshal(raw, &r); err != nil {
			return nil, err
		}
		if name, ok := strings.CutPrefix(r.Ref, "#/components/responses/"); ok {
			shared, ok := doc.Components.Responses[name]
			if !ok {
				return nil, fmt.Errorf("no response %s", r.Ref)
			}
			if err := json.Unmarshal(shared, &r); err != nil {
				return nil, err
			}
		}
		return r.Codes, nil
	}
	var ops []rawOperation
	for path, item := range doc.Paths {
		for method, raw := range item {
			switch method {
			case "get", "put", "post", "delete", "patch", "head", "options", "trace":
			default:
				continue // parameters, summary, extensions
			}
			var o struct {
				Role      string                     `json:"x-tally-role"`
				Responses map[string]json.RawMessage `json:"responses"`
			}
			if err := json.Unmarshal(raw, &o); err != nil {
				return nil, nil, fmt.Errorf("openapitest: %s %s: %w", method, path, err)
			}
			op := rawOperation{Operation: Operation{Method: strings.ToUpper(method), Path: path, Role: o.Role},
				codes: map[int][]string{}}
			for status, r := range o.Responses {
				n, err := strconv.Atoi(status)
				if err != nil || n < 400 {
					continue
				}
				codes, err := codesOf(r)
				if err != nil {
					return nil, nil, fmt.Errorf("openapitest: %s %s %s: %w", method, path, status, err)
				}
				if codes != nil {
					op.codes[n] = codes
				}
			}
			ops = append(ops, op)
		}
	}
	sort.Slice(ops, func(i, j int) bool {
		if ops[i].Path != ops[j].Path {
			return ops[i].Path < ops[j].Path
		}
		return ops[i].Method < ops[j].Method
	})
	unroutedCodes := map[int][]string{}
	for status, name := range unrouted {
		codes, err := codesOf(json.RawMessage(`{"$ref":"#/components/responses/` + name + `"}`))
		if err != nil || len(codes) == 0 {
			return nil, nil, fmt.Errorf("openapitest: the document has no components.responses.%s with its x-error-codes", name)
		}
		unroutedCodes[status] = codes
	}
	return ops, unroutedCodes, nil
}
