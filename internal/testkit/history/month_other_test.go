//go:build !unix

package history_test

import (
	"errors"
	"os"
)

func freeBytes(string) (int64, error) { return 0, errors.New("not measured on this system") }

// watchPeak measures nothing here: 0.
func watchPeak(int) func(*os.ProcessState) int64 { return func(*os.ProcessState) int64 { return 0 } }
