package benchstat

import (
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	t.Parallel()
	xs := []float64{3, 1, 2}
	if got := Median(xs); got != 2 {
		t.Fatalf("Median(3, 1, 2) = %v, want 2", got)
	}
	if xs[0] != 3 {
		t.Fatal("Median sorted its argument")
	}
	if got := Median([]time.Duration{4, 1, 3, 2}); got != 3 {
		t.Fatalf("Median(4, 1, 3, 2) = %v, want the upper middle 3", got)
	}
}
