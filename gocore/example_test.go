package gocore_test

import (
	"fmt"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

// A pool over the simulated device: the first allocation reserves a 2 MiB
// segment from the device, the freed block is cached, and the next
// allocation of that size is served from the cache without the device.
func ExampleNewPool() {
	device, err := sim.New(sim.Config{Capacity: 1 << 30})
	if err != nil {
		panic(err)
	}
	pool, err := gocore.NewPool(gocore.Config{Name: "example", Backend: device})
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	addr, err := pool.Alloc(0, 4096, 0) // 4 KiB on device 0, stream 0
	if err != nil {
		panic(err)
	}
	if err := pool.Free(addr); err != nil {
		panic(err)
	}
	again, err := pool.Alloc(0, 4096, 0)
	if err != nil {
		panic(err)
	}
	st, err := pool.Stats(0)
	if err != nil {
		panic(err)
	}
	fmt.Println("same address:", again == addr)
	fmt.Println("reserved bytes:", st.ReservedBytes[0].Current)
	fmt.Println("allocated bytes:", st.AllocatedBytes[0].Current)
	fmt.Println("device allocations:", st.NumDeviceAlloc, "cache hits:", st.NumCacheHits)
	// Output:
	// same address: true
	// reserved bytes: 2097152
	// allocated bytes: 4096
	// device allocations: 1 cache hits: 1
}

// The simulated device on its own, as a gocore.Backend: it hands out
// aligned segments and counts them.
func ExampleBackend() {
	device, err := sim.New(sim.Config{Capacity: 64 << 20})
	if err != nil {
		panic(err)
	}
	var be gocore.Backend = device
	addr, err := be.Alloc(0, 1000, 0) // device 0, 1000 bytes, stream 0
	if err != nil {
		panic(err)
	}
	fmt.Println("aligned:", addr%be.Alignment() == 0)
	total, free, _ := be.Capacity(0)
	fmt.Println("capacity:", total, "free:", free)
	if err := be.Free(0, addr, 1000, 0); err != nil {
		panic(err)
	}
	fmt.Println("live segments:", device.Stats().LiveSegments)
	// Output:
	// aligned: true
	// capacity: 67108864 free: 67107864
	// live segments: 0
}
