"""The controls of a pool's simulated device: ``pool.sim``.

A ``backend="sim"`` pool runs on a simulated device whose streams, events
and segment placement tests and replays steer; these controls are that
device's, not the pool's, so they live on their own object. On a pool of
another backend every control raises :class:`InvalidArgumentError` (the
engine says the pool is not sim).
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Optional

from . import _native
from ._args import U64, as_stream, check_bool, check_int, device_index

__all__ = ["SimControls", "warn_deprecated"]


class SimControls:
    """The simulated device of one pool (``pool.sim``)."""

    __slots__ = ("_call", "_handle")

    def __init__(self, call: Callable[..., Any], handle: Callable[[], int]) -> None:
        # The pool's native call (its error and callback rules) and its
        # handle getter (which refuses a closed pool): the controls hold no
        # pool state of their own.
        self._call = call
        self._handle = handle

    def complete(self, stream: Any = None) -> None:
        """Complete the queued work of ``stream`` (all streams when None) on
        the pool's simulated device."""
        b = _native.bindings
        self._call(b.SimCompleteStream, self._handle(), 0 if stream is None else as_stream(stream), stream is None)

    def manual_events(self, manual: bool = True) -> None:
        """Make the simulated device's events complete only on :meth:`complete`."""
        self._call(_native.bindings.SimSetManualEvents, self._handle(), check_bool("manual", manual))

    def place_next(self, offset: Optional[int], size: Optional[int] = None, device: Any = 0) -> None:
        """Put the next segment of exactly ``size`` bytes that the pool's
        simulated device hands out on ``device`` ``offset`` bytes into the
        device's placement window (the upper half of its address range, which
        first-fit allocation leaves alone), so that segments keep the address
        order of their offsets; ``offset=None`` or ``size=0`` withdraws the
        request. It holds for one segment of that size; if its range is taken
        then, that segment is placed first fit. Replays use it to give segments
        the address order the recording allocator's device gave them, which
        decides ties in best fit. ``offset`` must be a multiple of the
        device's alignment (512 bytes unless configured). A size is required
        with an offset: without one the call would silently withdraw."""
        if offset is None:
            offset, size = 0, 0
        elif size is None:
            raise ValueError("sim.place_next: give the segment size to place (offset=None withdraws the request)")
        self._call(_native.bindings.SimPlaceNext, self._handle(), device_index(device),
                   check_int("offset", offset, 0, U64), check_int("size", size, 0, U64))

    def stats(self) -> dict[str, int]:
        """Counters of the pool's simulated device (calls, live segments)."""
        return dict(json.loads(self._call(_native.bindings.SimStats, self._handle())))


def warn_deprecated(old: str) -> None:
    """Warn that ``MemPool.sim_<old>`` is now ``pool.sim.<old>``, at the
    caller of the deprecated method."""
    warnings.warn(f"MemPool.sim_{old}() is deprecated; use pool.sim.{old}()", DeprecationWarning, stacklevel=3)
