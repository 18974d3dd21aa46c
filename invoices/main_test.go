package invoices_test

import (
	"testing"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }
