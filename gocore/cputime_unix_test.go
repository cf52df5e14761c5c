//go:build unix

package gocore_test

import "syscall"

// processCPUTime returns the CPU time the process has used (user and
// system), in nanoseconds, and whether it could be read.
func processCPUTime() (int64, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return ru.Utime.Nano() + ru.Stime.Nano(), true
}
