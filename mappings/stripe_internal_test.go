package mappings

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// A meter that leaves a payload key empty reads Stripe's default key.
func TestKeysOfAnEmptyKeyIsTheDefault(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		meter stripeapi.Meter
		want  PayloadKeys
	}{
		{stripeapi.Meter{}, PayloadKeys{Customer: "stripe_customer_id", Value: "value"}},
		{stripeapi.Meter{CustomerPayloadKey: "cust"}, PayloadKeys{Customer: "cust", Value: "value"}},
		{stripeapi.Meter{ValuePayloadKey: "n"}, PayloadKeys{Customer: "stripe_customer_id", Value: "n"}},
		{stripeapi.Meter{CustomerPayloadKey: "cust", ValuePayloadKey: "n"}, PayloadKeys{Customer: "cust", Value: "n"}},
	} {
		require.Equal(t, tc.want, keysOf(tc.meter), "%+v", tc.meter)
	}
}
