package console

import "testing"

func TestGroupedAndPeriodText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"0": "0", "999": "999", "1000": "1,000", "-1234567": "-1,234,567",
		"123456": "123,456", "12x": "12x", "": "", "-": "-"} {
		if got := grouped(in); got != want {
			t.Errorf("grouped(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{"2026-12-01T00:00:00Z": "2026-12", "2026-12-15T10:30:00Z": "2026-12-15",
		"2026-11-30T23:00:00-01:00": "2026-12", "soon": "soon"} {
		if got := periodText(in); got != want {
			t.Errorf("periodText(%q) = %q, want %q", in, got, want)
		}
	}
}
