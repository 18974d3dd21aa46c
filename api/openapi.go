package api

import (
	"crypto/sha256"
	_ "embed" // the OpenAPI document
	"encoding/hex"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// openAPIPath is the OpenAPI document's route under /v1.
const openAPIPath = "/openapi.json"

// openAPIDocument is the OpenAPI 3.1 document of the /v1 API: api/openapi.json,
// kept in the repository and edited by hand, served as it is. The api
// package's tests check it against the router, the roles and the answers.
//
//go:embed openapi.json
var openAPIDocument []byte

// openAPIETag is the document's strong ETag, a digest of its bytes: it
// changes when they do.
var openAPIETag = func() string {
	sum := sha256.Sum256(openAPIDocument)
	return `"` + hex.EncodeToString(sum[:16]) + `"`
}()

// OpenAPI returns the OpenAPI 3.1 document of the /v1 API, as GET
// /v1/openapi.json serves it.
func OpenAPI() []byte { return slices.Clone(openAPIDocument) }

// serveOpenAPI is GET /v1/openapi.json: the document, to anyone (it holds
// nothing of a deployment). Clients revalidate (no-cache) with the ETag,
// so a node upgraded under them is seen at once: a matching If-None-Match
// answers 304 without the body.
func serveOpenAPI(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("ETag", openAPIETag)
	h.Set("Cache-Control", "no-cache")
	if etagListed(strings.Join(r.Header.Values("If-None-Match"), ","), openAPIETag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(openAPIDocument)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(openAPIDocument)
}

// etagListed reports whether an If-None-Match list names etag or is "*",
// comparing weakly as RFC 9110, section 13.1.2, says (a W/ prefix is
// ignored).
func etagListed(list, etag string) bool {
	for _, tag := range strings.Split(list, ",") {
		tag = strings.TrimPrefix(strings.TrimSpace(tag), "W/")
		if tag == "*" || tag == etag {
			return true
		}
	}
	return false
}
