package stripesim

import "crypto/rand"

const idAlphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// randomID returns prefix followed by n random base-62 characters.
func randomID(prefix string, n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand panics instead)
	for i, c := range b {
		b[i] = idAlphabet[int(c)%len(idAlphabet)]
	}
	return prefix + string(b)
}

func newRequestID() string { return randomID("req_", 14) }
