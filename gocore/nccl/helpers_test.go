//go:build cgo

package nccl_test

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/nccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/internal/fakenccl"
	"github.com/gpumempool/gpumempool/gocore/nccl/libnccl"
)

func TestMain(m *testing.M) {
	code := m.Run()
	fakenccl.Cleanup()
	os.Exit(code)
}

func builtLibs(t *testing.T) fakenccl.Libs {
	t.Helper()
	libs, err := fakenccl.Build()
	require.NoError(t, err, "building tests/csrc/fake_nccl.c with $CC (default cc)")
	return libs
}

// copyLib copies src into a new temporary file: a copy is a separate
// library to dlopen, with its own state and its own entry in Load's cache.
func copyLib(t *testing.T, src string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "libnccl-copy.so")
	in, err := os.Open(src)
	require.NoError(t, err)
	defer in.Close()
	out, err := os.Create(dst)
	require.NoError(t, err)
	_, err = io.Copy(out, in)
	require.NoError(t, err)
	require.NoError(t, out.Close())
	return dst
}

// freshLib loads a private copy of the fake and opens its controls, reset
// (FAKE_NCCL_CAPACITY is read now: set it before calling).
func freshLib(t *testing.T) (*libnccl.Lib, *fakenccl.Fake) {
	t.Helper()
	path := copyLib(t, builtLibs(t).Fake)
	lib, err := libnccl.Load(path)
	require.NoError(t, err)
	fake, err := fakenccl.Open(path)
	require.NoError(t, err)
	fake.Reset()
	return lib, fake
}

// stubEvents is an EventSource whose events complete after busyQueries
// "not yet" answers.
type stubEvents struct {
	mu          sync.Mutex
	devices     int
	total, free uint64 // 0: Capacity unsupported
	busyQueries int
	recordErr   error
	onDone      func() // called (unlocked) when a query first reports done

	next      gocore.Event
	live      map[gocore.Event]*stubEvent
	created   int
	destroyed int
	queries   int
	syncs     int
	streams   []gocore.Stream // recorded on, in order
}

type stubEvent struct {
	device   int
	recorded bool
	busy     int
}

func newStubEvents(devices int) *stubEvents {
	return &stubEvents{devices: devices, live: make(map[gocore.Event]*stubEvent)}
}

func (s *stubEvents) Devices() int { return s.devices }

func (s *stubEvents) Capacity(device int) (uint64, uint64, error) {
	if s.total == 0 {
		return 0, 0, fmt.Errorf("stub capacity: %w", gocore.ErrUnsupported)
	}
	return s.total, s.free, nil
}

func (s *stubEvents) NewEvent(device int) (gocore.Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if device < 0 || device >= s.devices {
		return 0, fmt.Errorf("stub event on device %d: %w", device, gocore.ErrInvalidDevice)
	}
	s.next++
	s.live[s.next] = &stubEvent{device: device}
	s.created++
	return s.next, nil
}

func (s *stubEvents) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.live[ev]
	if e == nil {
		return fmt.Errorf("stub record: unknown event %d: %w", ev, gocore.ErrInvalidArgument)
	}
	if s.recordErr != nil {
		return s.recordErr
	}
	e.recorded, e.busy = true, s.busyQueries
	s.streams = append(s.streams, stream)
	return nil
}

// SynchronizeEvent completes ev's work, as a wait would.
func (s *stubEvents) SynchronizeEvent(ev gocore.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.live[ev]
	if e == nil {
		return fmt.Errorf("stub synchronize: unknown event %d: %w", ev, gocore.ErrInvalidArgument)
	}
	s.syncs++
	e.busy = 0
	return nil
}

func (s *stubEvents) QueryEvent(ev gocore.Event) (bool, error) {
	s.mu.Lock()
	e := s.live[ev]
	if e == nil {
		s.mu.Unlock()
		return false, fmt.Errorf("stub query: unknown event %d: %w", ev, gocore.ErrInvalidArgument)
	}
	s.queries++
	if e.busy > 0 {
		e.busy--
		s.mu.Unlock()
		return false, nil
	}
	first := e.recorded
	e.recorded = false
	onDone := s.onDone
	s.mu.Unlock()
	if first && onDone != nil {
		onDone()
	}
	return true, nil
}

func (s *stubEvents) DestroyEvent(ev gocore.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.live[ev] == nil {
		return fmt.Errorf("stub destroy: unknown event %d: %w", ev, gocore.ErrInvalidArgument)
	}
	delete(s.live, ev)
	s.destroyed++
	return nil
}

func (s *stubEvents) counts() (created, destroyed, queries int, streams []gocore.Stream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.created, s.destroyed, s.queries, append([]gocore.Stream(nil), s.streams...)
}

// fakeCtx is a ContextSource over the fake's context stack: device d's
// context is 0x1000+d.
type fakeCtx struct {
	fake *fakenccl.Fake
	err  error
	zero bool // hand out a zero context
}

func ctxOf(dev int) uintptr { return 0x1000 + uintptr(dev) }

func (c *fakeCtx) ContextFuncs(dev int) (uintptr, uintptr, uintptr, error) {
	if c.err != nil {
		return 0, 0, 0, c.err
	}
	if c.zero {
		return 0, c.fake.PushFunc(), c.fake.PopFunc(), nil
	}
	return ctxOf(dev), c.fake.PushFunc(), c.fake.PopFunc(), nil
}

// setup is a fresh fake library, a backend over it with two devices, and the
// pieces to look at.
type setup struct {
	lib     *libnccl.Lib
	fake    *fakenccl.Fake
	events  *stubEvents
	ctx     *fakeCtx
	backend *nccl.Backend
}

func newSetup(t *testing.T) *setup {
	t.Helper()
	lib, fake := freshLib(t)
	s := &setup{lib: lib, fake: fake, events: newStubEvents(2), ctx: &fakeCtx{fake: fake}}
	var err error
	s.backend, err = nccl.NewBackend(lib, s.ctx, s.events)
	require.NoError(t, err)
	return s
}

// popLeftover undoes what a failed pop (CtxFail(0, code)) left on this
// thread: device 0's context, pushed on top of the depth the thread had.
func (s *setup) popLeftover(t *testing.T, depth int) {
	t.Helper()
	s.fake.CtxFail(0, 0)
	assert.Equal(t, depth+1, s.fake.Depth())
	ctx, r := s.fake.Pop()
	assert.Zero(t, r)
	assert.Equal(t, ctxOf(0), ctx)
}

func (s *setup) pool(t *testing.T) *gocore.Pool {
	t.Helper()
	p, err := gocore.NewPool(gocore.Config{Name: "nccl-test", Backend: s.backend})
	require.NoError(t, err)
	return p
}
