package api_test

import (
	"testing"

	"github.com/tallymeter/tally/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }
