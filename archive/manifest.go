package archive

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

// ManifestFormat is the version of the manifest's shape.
const ManifestFormat = 1

// manifestName is the manifest's file name in a generation's prefix.
const manifestName = "manifest.json"

// Manifest describes one generation of a period's archive. It is stored
// beside the files (manifest.json) and in the archives table; its sha256
// is the archive's fingerprint.
type Manifest struct {
	Format     int    `json:"format"`
	Period     string `json:"period"`
	Generation int    `json:"generation"`
	// Location is the store and prefix of the files.
	Location string `json:"location"`
	// WrittenAt is the database's clock when the snapshot was read (UTC).
	WrittenAt time.Time `json:"written_at"`
	WrittenBy string    `json:"written_by"`
	Files     []File    `json:"files"`
	// Completeness is the period's report as the full computation
	// (quarantine.LedgerCompletenessOf) reads it in the files' snapshot.
	Completeness quarantine.Completeness `json:"completeness"`
	// LedgerMonths counts the archived ledger rows by the month ("YYYY-MM",
	// UTC) they occurred in: a detach drops a month of the ledger only when
	// the archives of the periods it holds count exactly its rows.
	LedgerMonths map[string]int64 `json:"ledger_months"`
}

// File is one archive file as written.
type File struct {
	Name  string `json:"name"`
	Table string `json:"table"`
	Rows  int64  `json:"rows"`
	Bytes int64  `json:"bytes"`
	// SHA256 is the lowercase hex sha256 of the file's bytes.
	SHA256 string `json:"sha256"`
	// IDColumn, MinID and MaxID are the range of ids archived (absent for
	// an empty file).
	IDColumn string `json:"id_column"`
	MinID    *int64 `json:"min_id,omitempty"`
	MaxID    *int64 `json:"max_id,omitempty"`
}

// encode is the manifest as stored, and its sha256.
func (m Manifest) encode() ([]byte, string, error) {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, "", fmt.Errorf("archive: manifest: %w", err)
	}
	b = append(b, '\n')
	sum := sha256.Sum256(b)
	return b, hex.EncodeToString(sum[:]), nil
}

// sha256Hex is the lowercase hex sha256 of b.
func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// prefix is where generation g of period p lives in a store.
func prefix(period string, generation int) string {
	return fmt.Sprintf("%s/g%04d", period, generation)
}
