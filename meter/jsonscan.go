package meter

import "unicode/utf8"

// The field-by-field analysis (decodeSlow) walks the body with the functions
// of this file. They take JSON json.Valid has accepted (every string closed,
// every bracket matched) and never allocate.

// skipSpace is the index of the first byte at or after i that is not JSON
// whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd is the index just past the string that starts at b[i] (a '"').
func stringEnd(b []byte, i int) int {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++ // the escaped byte
		case '"':
			return j + 1
		}
	}
	return len(b)
}

// valueEnd is the index just past the value that starts at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				i = stringEnd(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
		return len(b)
	default: // a number, true, false or null
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return len(b)
	}
}

// members calls fn with each member of the object obj (which starts with
// '{'), in order: its key as written, quotes included, and its value.
func members(obj []byte, fn func(key, value []byte)) {
	i := skipSpace(obj, 1)
	for i < len(obj) && obj[i] == '"' {
		end := stringEnd(obj, i)
		key := obj[i:end]
		i = skipSpace(obj, skipSpace(obj, end)+1) // past the colon
		if i >= len(obj) {
			return
		}
		vend := valueEnd(obj, i)
		fn(key, obj[i:vend])
		if i = skipSpace(obj, vend); i < len(obj) && obj[i] == ',' {
			i = skipSpace(obj, i+1)
		}
	}
}

// elements calls fn with each element of the array arr (which starts with
// '['), in order, until fn returns false.
func elements(arr []byte, fn func(value []byte) bool) {
	i := skipSpace(arr, 1)
	for i < len(arr) && arr[i] != ']' {
		end := valueEnd(arr, i)
		if !fn(arr[i:end]) {
			return
		}
		if i = skipSpace(arr, end); i < len(arr) && arr[i] == ',' {
			i = skipSpace(arr, i+1)
		}
	}
}

// fieldNamed reports which of names the key (as written, quotes included)
// is once its escapes are decoded, as encoding/json would decode it; it
// decodes into a small buffer on the stack, so that a key that names no
// field costs no allocation.
func fieldNamed(quoted []byte, names ...string) (string, bool) {
	var buf [16]byte
	key := quoted[1 : len(quoted)-1]
	n := 0
	for i := 0; i < len(key); i++ {
		if n == len(buf) {
			return "", false // longer than any field name
		}
		c := key[i]
		if c == '\\' {
			i++
			switch key[i] {
			case '"', '\\', '/':
				c = key[i]
			case 'u':
				if i+5 > len(key) {
					return "", false
				}
				v, ok := hex4(key[i+1 : i+5])
				if !ok || v >= utf8.RuneSelf {
					return "", false // no field name holds anything but ASCII
				}
				c, i = byte(v), i+4
			default:
				return "", false // a control character: in no field name
			}
		}
		buf[n] = c
		n++
	}
	for _, name := range names {
		if string(buf[:n]) == name {
			return name, true
		}
	}
	return "", false
}

// hex4 decodes the four hexadecimal digits of a \u escape.
func hex4(h []byte) (rune, bool) {
	var v rune
	for _, c := range h {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return 0, false
		}
		v = v<<4 | rune(c)
	}
	return v, true
}
