//go:build !unix

package gocore

// processCPUTime cannot read the process's CPU time here.
func processCPUTime() (int64, bool) { return 0, false }
