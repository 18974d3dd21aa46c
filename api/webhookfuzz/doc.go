// Package webhookfuzz holds the fuzz target of api.ParseStripeEvent, the
// parser of Stripe's event destination. It lives apart from package api's
// tests so that a fuzz build, which instruments every package its test
// binary links, does not instrument the OpenAPI validator those tests use
// (api/openapitest), whose instrumented build takes minutes.
// It owns no code of its own and must never be imported.
package webhookfuzz
