//go:build !linux

package gocore

// callerThread is 0 where the OS thread id is not at hand: entries are then
// matched to calls by time alone.
func callerThread() int { return 0 }
