package gocore_test

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	. "github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/sim"
)

func TestLimit(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{Limit: 4 * MiB})
	mustAlloc(t, p, 0, MiB, 0)
	mustAlloc(t, p, 0, MiB, 0)
	mustAlloc(t, p, 0, MiB, 0)
	mustAlloc(t, p, 0, MiB, 0)
	oom := mustOOM(t, p, 0, MiB)
	assert.EqualValues(t, 4*MiB, oom.Limit)
	assert.EqualValues(t, 4*MiB, oom.Reserved)
	assert.EqualValues(t, 4*MiB, oom.Allocated)
	assert.Nil(t, oom.Cause)
	assert.Contains(t, oom.Error(), "limit 4.00 MiB")
	require.NoError(t, p.SetLimit(0))
	mustAlloc(t, p, 0, MiB, 0)
}

func TestDeviceLimit(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{Devices: 2}, Config{Limit: 8 * MiB})
	require.NoError(t, p.SetDeviceLimit(1, 2*MiB))
	assert.EqualValues(t, 8*MiB, p.Limit(0))
	assert.EqualValues(t, 2*MiB, p.Limit(1))

	mustAlloc(t, p, 1, MiB, 0)
	mustAlloc(t, p, 1, MiB, 0)
	oom := mustOOM(t, p, 1, MiB)
	assert.EqualValues(t, 2*MiB, oom.Limit)
	assert.Equal(t, 1, oom.Device)
	for range 8 { // device 0 keeps the pool-wide limit
		mustAlloc(t, p, 0, MiB, 0)
	}
	assert.EqualValues(t, 8*MiB, mustOOM(t, p, 0, MiB).Limit)

	require.ErrorIs(t, p.SetDeviceLimit(2, MiB), ErrInvalidDevice)
	require.ErrorIs(t, p.SetDeviceLimit(-1, MiB), ErrInvalidDevice)

	// SetLimit applies to every device and drops single-device limits.
	require.NoError(t, p.SetLimit(0))
	assert.Zero(t, p.Limit(1))
	mustAlloc(t, p, 1, MiB, 0)
	mustAlloc(t, p, 0, MiB, 0)
	require.NoError(t, p.CheckInvariants())
}

// Pools sharing a budget share its limits: each device's limit holds for
// what they reserve together, and a limit set through one is the other's.
func TestPoolsSharingABudgetShareItsLimit(t *testing.T) {
	p, be := newTestPool(t, sim.Config{Devices: 2}, Config{Limit: 24 * MiB})
	cfg := p.Config()
	cfg.Limit = 0 // ignored: the shared budget holds the limit
	q, err := NewPool(cfg)
	require.NoError(t, err)
	mustAlloc(t, p, 0, 12*MiB, 0)
	mustAlloc(t, q, 0, 12*MiB, 0)
	_, err = q.Alloc(0, 2*MiB, 0)
	require.ErrorIs(t, err, ErrOutOfMemory, "24 MiB reserved by the two")
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.EqualValues(t, 24*MiB, oom.Limit)
	mustAlloc(t, q, 1, 2*MiB, 0) // another device's budget
	assert.EqualValues(t, 24*MiB, p.Budget().Reserved(0))

	require.NoError(t, q.SetDeviceLimit(0, 40*MiB))
	assert.EqualValues(t, 40*MiB, p.Limit(0))
	mustAlloc(t, p, 0, 12*MiB, 0)
	_, err = q.Close()
	require.NoError(t, err)
	assert.EqualValues(t, 24*MiB, p.Budget().Reserved(0), "q's segments went back")
	mustAlloc(t, p, 0, 12*MiB, 0)
	assert.Equal(t, 3, be.Stats().LiveSegments)

	other, err := sim.New(sim.Config{Devices: 3})
	require.NoError(t, err)
	cfg.Backend = other
	_, err = NewPool(cfg)
	assert.ErrorIs(t, err, ErrInvalidArgument, "a budget for 2 devices over a 3-device backend")
}

// slowAlloc is a sim backend whose Alloc waits for a second caller (at
// most a second), so that two pools sharing a budget allocate at once.
type slowAlloc struct {
	*sim.Backend
	wg sync.WaitGroup
}

func (b *slowAlloc) Alloc(device int, size uint64, stream Stream) (uint64, error) {
	b.wg.Done()
	done := make(chan struct{})
	go func() { b.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Second):
	}
	return b.Backend.Alloc(device, size, stream)
}

// Pools sharing a budget check and count a new segment in one step: two
// allocating at once cannot both pass the limit.
func TestSharedBudgetHoldsUnderConcurrentAllocations(t *testing.T) {
	device, err := sim.New(sim.Config{})
	require.NoError(t, err)
	be := &slowAlloc{Backend: device}
	be.wg.Add(2)
	p, err := NewPool(Config{Backend: be, Limit: 20 * MiB})
	require.NoError(t, err)
	q, err := NewPool(p.Config())
	require.NoError(t, err)
	var g errgroup.Group
	var ooms atomic.Int32
	for _, pool := range []*Pool{p, q} {
		g.Go(func() error {
			if _, err := pool.Alloc(0, 20*MiB, 0); errors.Is(err, ErrOutOfMemory) {
				ooms.Add(1)
			} else if err != nil {
				return err
			}
			return nil
		})
	}
	require.NoError(t, g.Wait())
	assert.EqualValues(t, 1, ooms.Load())
	assert.EqualValues(t, 20*MiB, p.Budget().Reserved(0))
	assert.EqualValues(t, 20*MiB, device.UsedBytes(0))
}

// The numbers of an OOM under a shared limit explain it; garbage
// collection counts what the pools sharing the limit reserve.
func TestSharedBudgetInOOMErrorsAndGarbageCollection(t *testing.T) {
	p, _ := newTestPool(t, sim.Config{}, Config{Limit: 2 * MiB})
	q, err := NewPool(p.Config())
	require.NoError(t, err)
	mustAlloc(t, q, 0, MiB, 0)
	_, err = p.Alloc(0, MiB, 0)
	var oom *OutOfMemoryError
	require.ErrorAs(t, err, &oom)
	assert.EqualValues(t, 0, oom.Reserved)
	assert.EqualValues(t, 2*MiB, oom.SharedReserved)
	assert.Contains(t, err.Error(), "(2.00 MiB reserved by the pools sharing it)")

	gp, _ := newTestPool(t, sim.Config{}, Config{Limit: 100 * MiB, GarbageCollectionThreshold: 0.5})
	gq, err := NewPool(gp.Config())
	require.NoError(t, err)
	mustAlloc(t, gq, 0, 40*MiB, 0)
	require.NoError(t, gp.Free(mustAlloc(t, gp, 0, 20*MiB, 0)))
	mustAlloc(t, gp, 0, 22*MiB, 0) // 82 MiB reserved in all: over half the limit
	assert.NotZero(t, stats(t, gp).NumGCReleases, "the cached 20 MiB segment went")
}
