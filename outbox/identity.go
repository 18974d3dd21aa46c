package outbox

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Identity is what makes an item unique in the database. Its identifier, the
// provider's idempotency key, is a pure function of it.
type Identity struct {
	// TenantKey is the tenant the usage belongs to.
	TenantKey string
	// SubjectKind says what SubjectRef names: SubjectUsageWindow or
	// SubjectUsageEvent.
	SubjectKind string
	// SubjectRef names the usage: "usage:<feature>:<period_start>:<from>:<to>"
	// for a window (with "#<n>" for a supplement), "event:<feature>:<id>" for
	// a per-event item.
	SubjectRef string
	// Exporter names the exporter, e.g. "stripe_meter_events".
	Exporter string
	// DestinationAccount is the provider account the item is addressed to;
	// empty only for an item quarantined as no_account.
	DestinationAccount string
	// Mode is ModeLive or ModeTest.
	Mode Mode
	// MappingVersion is the version of the mapping the payload was built
	// from; 0 when there was none (feature_unmapped).
	MappingVersion int
}

// Subject kinds.
const (
	SubjectUsageWindow = "usage_window"
	SubjectUsageEvent  = "usage_event"
	// SubjectUsageCancellation is an item that takes back an event Stripe
	// may have (a cancellation): a meter event adjustment
	// cancelling the identifier in Payload.Cancels, or, without one, a
	// meter event of the negated value offsetting an event of a sum window.
	SubjectUsageCancellation = "usage_cancellation"
)

// Mode is the provider's mode an item is addressed to.
type Mode string

// Modes.
const (
	ModeLive Mode = "live"
	ModeTest Mode = "test"
)

// IdentifierPrefix starts every identifier.
const IdentifierPrefix = "tly_"

// IdentifierLength is the length of every identifier: the prefix and 64 hex
// digits, inside Stripe's 100-character limit.
const IdentifierLength = len(IdentifierPrefix) + 2*sha256.Size

// Identifier returns the provider idempotency key of the identity:
//
//	"tly_" + hex(sha256(tenant_key|subject_kind|subject_ref|exporter|destination_account|mode|mapping_version))
//
// with mapping_version in decimal. There is no nonce: every retry of an item
// carries the same identifier, which is what lets the provider deduplicate.
// The database computes the same function for its identifier column.
func (id Identity) Identifier() string {
	h := sha256.Sum256([]byte(strings.Join([]string{
		id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter,
		id.DestinationAccount, string(id.Mode), strconv.Itoa(id.MappingVersion),
	}, "|")))
	return IdentifierPrefix + hex.EncodeToString(h[:])
}

var (
	kindPattern     = regexp.MustCompile(`^[a-z][a-z_]*$`)
	exporterPattern = regexp.MustCompile(`^[a-z][a-z0-9_]*$`)
)

// Validate reports the first problem that makes the identity unusable. The
// separator "|" may not appear in any free-text field, so that two different
// identities can never hash the same string.
func (id Identity) Validate() error {
	var errs []error
	if id.TenantKey == "" {
		errs = append(errs, errors.New("tenant_key is empty"))
	}
	if !kindPattern.MatchString(id.SubjectKind) {
		errs = append(errs, fmt.Errorf("subject_kind %q is not a lower-case word", id.SubjectKind))
	}
	if id.SubjectRef == "" {
		errs = append(errs, errors.New("subject_ref is empty"))
	}
	if !exporterPattern.MatchString(id.Exporter) {
		errs = append(errs, fmt.Errorf("exporter %q is not a lower-case name", id.Exporter))
	}
	if id.Mode != ModeLive && id.Mode != ModeTest {
		errs = append(errs, fmt.Errorf("mode %q is neither live nor test", id.Mode))
	}
	if id.MappingVersion < 0 {
		errs = append(errs, fmt.Errorf("mapping_version %d is negative", id.MappingVersion))
	}
	for _, f := range [...]struct{ name, value string }{
		{"tenant_key", id.TenantKey}, {"subject_ref", id.SubjectRef}, {"destination_account", id.DestinationAccount},
	} {
		if strings.Contains(f.value, "|") {
			errs = append(errs, fmt.Errorf("%s contains the separator '|'", f.name))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox: invalid identity: %w", errors.Join(errs...))
	}
	return nil
}

// readdressMark joins a subject ref and its re-address generation. A "%"
// never stands for itself in a ref — an event id's is percent-encoded, and a
// feature name has none — and a percent-encoding is followed by two hex
// digits, never "r": the mark cannot be mistaken for part of the ref.
const readdressMark = "%r"

// ReaddressRef returns the subject ref for re-addressing an item of ref
// under a new identifier while nothing else of its identity changes: ref
// with its re-address generation raised by one ("<ref>%r1", then
// "<ref>%r2"). An item gets one only when the provider is proven not to
// have recorded any attempt of it (every attempt refused, or failed by the
// provider's error report): a new identifier then cannot bill twice, and it
// cannot collide with whatever the provider remembers of the old one.
func ReaddressRef(ref string) string {
	base, gen := splitReaddress(ref)
	return base + readdressMark + strconv.Itoa(gen+1)
}

// BaseRef returns ref without its re-address generation: the usage it names.
func BaseRef(ref string) string {
	base, _ := splitReaddress(ref)
	return base
}

func splitReaddress(ref string) (base string, gen int) {
	i := strings.LastIndex(ref, readdressMark)
	if i < 0 {
		return ref, 0
	}
	digits := ref[i+len(readdressMark):]
	n, err := strconv.Atoi(digits)
	if err != nil || n < 1 || strconv.Itoa(n) != digits {
		return ref, 0
	}
	return ref[:i], n
}
