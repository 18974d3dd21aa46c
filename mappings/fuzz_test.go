package mappings

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// FuzzFeatureInput decodes a PUT body as the API does and validates it:
// nothing panics, and whatever validates is a mapping Tally can stage —
// a meter event name Stripe accepts, a known aggregation, a window that
// divides a day, a known exporter or none — and survives a JSON round trip unchanged.
func FuzzFeatureInput(f *testing.F) {
	for _, seed := range []struct{ feature, body string }{
		{"api", `{"event_name":"api_calls","aggregation":"sum"}`},
		{"api", `{"event_name":"api_calls","aggregation":"sum","window":"15m"}`},
		{"seats", `{"event_name":"seats","aggregation":"last","window":"24h"}`},
		{"x", `{"event_name":"","aggregation":"avg","window":"7m"}`},
		{"x", `{"event_name":"a","aggregation":"count","window":"-1h"}`},
		{"x", `{"event_name":"a","aggregation":"sum","window":"1h0m0.5s"}`},
		{"x", `{"event_name":"a","aggregation":"sum","window":9223372036854775807}`},
		{"-bad", `{"event_name":"a b","aggregation":"sum"}`},
		{"x", `{"event_name":"a","aggregation":"sum","window":"90000h"}`},
		{"api", `{"event_name":"api_calls","aggregation":"sum","exporter":"stripe_meter_event_stream"}`},
		{"api", `{"event_name":"api_calls","aggregation":"count","exporter":"stripe_meter_events"}`},
		{"api", `{"event_name":"api_calls","aggregation":"sum","exporter":"stripe_meter_events|x"}`},
	} {
		f.Add(seed.feature, []byte(seed.body))
	}
	f.Fuzz(func(t *testing.T, feature string, body []byte) {
		var in FeatureInput
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&in); err != nil {
			return
		}
		if err := in.validate(feature); err != nil {
			var ve *ValidationError
			if !isValidation(err, &ve) || len(ve.Fields) == 0 {
				t.Fatalf("validate returned %T %v, want a *ValidationError naming fields", err, err)
			}
			return
		}
		if !ValidName(feature) || !eventNamePattern.MatchString(in.EventName) {
			t.Fatalf("accepted feature %q with event name %q", feature, in.EventName)
		}
		switch in.Aggregation {
		case Sum, Last, Count:
		default:
			t.Fatalf("accepted aggregation %q", in.Aggregation)
		}
		if in.Exporter != ExporterDefault && in.Exporter != ExporterStripeMeterEvents && in.Exporter != ExporterStripeMeterEventStream {
			t.Fatalf("accepted exporter %q", in.Exporter)
		}
		w := time.Duration(in.Window)
		if w < time.Minute || w > 24*time.Hour || (24*time.Hour)%w != 0 || w%time.Second != 0 {
			t.Fatalf("accepted window %s", w)
		}
		out, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		var again FeatureInput
		if err := json.Unmarshal(out, &again); err != nil || again != in {
			t.Fatalf("round trip %s gave %+v (%v), want %+v", out, again, err, in)
		}
		if strings.ContainsAny(in.EventName, "|\x00") {
			t.Fatalf("event name %q holds a separator", in.EventName)
		}
	})
}

func isValidation(err error, target **ValidationError) bool {
	ve, ok := err.(*ValidationError)
	*target = ve
	return ok
}
