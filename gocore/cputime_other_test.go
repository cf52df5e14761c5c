//go:build !unix

package gocore_test

// processCPUTime cannot read the process's CPU time here.
func processCPUTime() (int64, bool) { return 0, false }
