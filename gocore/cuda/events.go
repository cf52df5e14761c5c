package cuda

import (
	"fmt"
	"sync"

	"github.com/gpumempool/gpumempool/gocore"
	"github.com/gpumempool/gpumempool/gocore/cuda/driver"
)

// Events is the event half of every backend of the package (the
// gocore.EventSource methods, and gocore.EventSynchronizer): CUDA events
// created with CU_EVENT_DISABLE_TIMING (the engine only orders work with
// them), each recorded, queried, waited for and destroyed under the context
// of the CUDA device it was created on. A backend embeds its *Events, so
// that it forwards no event method by hand; AsyncBackend and VMMBackend
// share the one of the Backend they are built on. It is safe for
// concurrent use.
type Events struct {
	drv *driver.Driver
	who string // names the backend in errors: "cuda backend"
	// device maps the device a pool asks for to the CUDA device whose
	// context holds its events, or fails (op names the call).
	device func(op string, dev int) (int, error)

	mu   sync.Mutex
	live map[gocore.Event]int // live event -> its CUDA device
}

var (
	_ gocore.EventSource       = (*Events)(nil)
	_ gocore.EventSynchronizer = (*Events)(nil)
)

// newEvents returns the events of the backend named who, created on the
// CUDA device that device maps a pool's device to.
func newEvents(drv *driver.Driver, who string, device func(op string, dev int) (int, error)) *Events {
	return &Events{drv: drv, who: who, device: device, live: make(map[gocore.Event]int)}
}

// NewEvent creates an event on the CUDA device of dev.
func (e *Events) NewEvent(dev int) (gocore.Event, error) {
	cudaDev, err := e.device("new event", dev)
	if err != nil {
		return 0, err
	}
	ev, err := e.drv.EventCreate(cudaDev)
	if err != nil {
		return 0, err
	}
	e.mu.Lock()
	e.live[gocore.Event(ev)] = cudaDev
	e.mu.Unlock()
	return gocore.Event(ev), nil
}

// deviceOf returns the CUDA device of a live event.
func (e *Events) deviceOf(op string, ev gocore.Event) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	dev, ok := e.live[ev]
	if !ok {
		return 0, fmt.Errorf("%s: %s unknown event %#x: %w", e.who, op, uint64(ev), gocore.ErrInvalidArgument)
	}
	return dev, nil
}

// RecordEvent records ev on stream, a stream of the event's CUDA device.
func (e *Events) RecordEvent(ev gocore.Event, stream gocore.Stream) error {
	dev, err := e.deviceOf("record", ev)
	if err != nil {
		return err
	}
	return e.drv.EventRecord(dev, uint64(ev), uint64(stream))
}

// QueryEvent reports whether the work captured by ev has completed.
func (e *Events) QueryEvent(ev gocore.Event) (bool, error) {
	dev, err := e.deviceOf("query", ev)
	if err != nil {
		return false, err
	}
	return e.drv.EventQuery(dev, uint64(ev))
}

// SynchronizeEvent waits for the work captured by ev
// (gocore.EventSynchronizer).
func (e *Events) SynchronizeEvent(ev gocore.Event) error {
	dev, err := e.deviceOf("synchronize", ev)
	if err != nil {
		return err
	}
	return e.drv.EventSynchronize(dev, uint64(ev))
}

// DestroyEvent destroys ev. The entry leaves the event table before
// cuEventDestroy: once the driver destroyed the event it may hand the same
// handle to a NewEvent on another thread, whose fresh entry a later delete
// would remove. Should cuEventDestroy fail, the event is still alive and its
// entry is put back.
func (e *Events) DestroyEvent(ev gocore.Event) error {
	e.mu.Lock()
	dev, ok := e.live[ev]
	delete(e.live, ev)
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("%s: destroy unknown event %#x: %w", e.who, uint64(ev), gocore.ErrInvalidArgument)
	}
	if err := e.drv.EventDestroy(dev, uint64(ev)); err != nil {
		e.mu.Lock()
		e.live[ev] = dev // still alive, so its handle cannot have been reused
		e.mu.Unlock()
		return err
	}
	return nil
}

// LiveEvents reports how many events were created and not destroyed.
func (e *Events) LiveEvents() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.live)
}
