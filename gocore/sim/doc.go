// Package sim is a simulated device: a gocore.Backend (also an Expander,
// Shrinker and PageMapper) that hands out addresses from a per-device
// address range without any GPU, for tests, demos and trace replay.
//
// It lives beside the other backends (callback, cuda, nccl) rather than in
// the engine's root: the engine knows backends only through gocore.Backend.
// The files follow its concepts: config.go (Config, its checks, New),
// backend.go (the Backend and its devices), addrspace.go (free address
// ranges and PlaceNext), segments.go (Alloc and Free), expandable.go
// (Expand, Shrink, Map, Unmap), events.go (streams and events, manual
// completion) and stats.go (counters and live segments).
package sim
