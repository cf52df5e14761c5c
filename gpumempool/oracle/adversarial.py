"""Allocation traces made to find where the engine and torch part ways:
sizes at every small/large/oversize and rounding boundary, many streams
with ``record_stream`` and late completion, ``empty_cache`` in the middle,
and memory pressure that forces release-and-retry and out-of-memory under a
memory fraction. Each is seeded, so a difference found once is found again.

    from gpumempool.oracle import adversarial
    trace = adversarial.make("pressure", seed=3)

:data:`KINDS` names them; :func:`make` builds one. The traces need no
recording: both sides are replayed from the same events.
"""

from __future__ import annotations

import random
from typing import Callable

from ..trace import Alloc, EmptyCache, Event, Free, RecordStream, Sync, Trace

__all__ = ["KINDS", "make", "BOUNDARY_SIZES"]

KiB, MiB = 1 << 10, 1 << 20

#: Sizes just below, at and above each boundary torch's allocator decides
#: on: the 512-byte minimum block, the small pool's 1 MiB limit, the 2 MiB
#: small segment, the 10 MiB "large buffer" limit, the 20 MiB large
#: segment, the 2 MiB rounding of large requests, powers of two (for
#: roundup_power2_divisions) and max_split_size candidates (64, 256 MiB).
BOUNDARY_SIZES: tuple[int, ...] = tuple(sorted({
    max(1, b + d)
    for b in (512, 1 * MiB, 2 * MiB, 10 * MiB, 20 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 4 * KiB,
              512 * KiB, 6 * MiB, 40 * MiB)
    for d in (-513, -512, -1, 0, 1, 511, 512)
}))


def _boundaries(rng: random.Random) -> list[Event]:
    """Every boundary size, kept and freed in shuffled orders, so that
    splits, merges and best fit meet each one."""
    ev: list[Event] = []
    live: list[int] = []
    ident = 0
    for _ in range(4):
        sizes = list(BOUNDARY_SIZES)
        rng.shuffle(sizes)
        for size in sizes:
            ident += 1
            ev.append(Alloc(ident, size))
            live.append(ident)
            if len(live) > 12 and rng.random() < 0.6:
                ev.append(Free(live.pop(rng.randrange(len(live)))))
        rng.shuffle(live)
        while len(live) > 4:
            ev.append(Free(live.pop()))
    ev += [Free(i) for i in live]
    return ev


def _streams(rng: random.Random) -> list[Event]:
    """Eight streams, blocks used on other streams (``record_stream``) and
    freed before those streams complete; completion comes late and in no
    order, so torch's events and the engine's must keep the same blocks out
    of reach for the same time."""
    streams = [0] + [0x1000 * (k + 1) for k in range(7)]
    ev: list[Event] = []
    live: dict[int, int] = {}
    for ident in range(1, 1500):
        s = rng.choice(streams)
        size = rng.choice([rng.randrange(1, 1 * MiB), rng.randrange(1 * MiB, 12 * MiB), rng.randrange(12, 90) * MiB])
        ev.append(Alloc(ident, size, s))
        live[ident] = s
        if rng.random() < 0.3:
            ev.append(RecordStream(ident, rng.choice(streams)))
        if len(live) > 30 or rng.random() < 0.35:
            victim = rng.choice(list(live))
            del live[victim]
            ev.append(Free(victim))
        if rng.random() < 0.05:
            ev.append(Sync(rng.choice(streams)))
        if rng.random() < 0.01:
            ev.append(Sync(None))
    ev += [Free(i) for i in live]
    return ev


def _empty_cache(rng: random.Random) -> list[Event]:
    """A training-like loop of variable shapes with ``empty_cache`` every
    few steps, some with blocks still pending on another stream."""
    ev: list[Event] = []
    ident = 0
    keep = []
    for _ in range(8):
        ident += 1
        ev.append(Alloc(ident, rng.randrange(1, 200) * MiB))
        keep.append(ident)
    for step in range(60):
        acts = []
        for _ in range(rng.randrange(10, 40)):
            ident += 1
            ev.append(Alloc(ident, rng.choice([rng.randrange(1, 600 * KiB), rng.randrange(1, 80) * MiB + 17])))
            acts.append(ident)
            if rng.random() < 0.1:
                ev.append(RecordStream(ident, 0x2000))
        rng.shuffle(acts)
        ev += [Free(i) for i in acts]
        if step % 7 == 3:
            ev.append(EmptyCache())
        if step % 5 == 0:
            ev.append(Sync(0x2000))
    ev += [Free(i) for i in keep]
    return ev


def _pressure(rng: random.Random) -> list[Event]:
    """Sized for a 4 GiB device: the working set swings between a quarter
    and more than all of it, with fragmenting small and odd sizes, so a run
    under a memory fraction releases its cache and retries, and sometimes
    runs out (the out-of-memory is an event, the run goes on)."""
    ev: list[Event] = []
    live: list[tuple[int, int]] = []
    total = 0
    ident = 0
    for _ in range(2500):
        target = rng.choice([1, 2, 3, 4, 5]) << 30
        if total < target and rng.random() < 0.6:
            size = rng.choice([rng.randrange(1, 2 * MiB), rng.randrange(2, 40) * MiB + rng.randrange(512),
                               rng.randrange(40, 700) * MiB])
            ident += 1
            ev.append(Alloc(ident, size))
            live.append((ident, size))
            total += size
        elif live:
            i, size = live.pop(rng.randrange(len(live)))
            ev.append(Free(i))
            total -= size
    ev += [Free(i) for i, _ in live]
    return ev


def _random(rng: random.Random) -> list[Event]:
    """Random sizes across all ranges on two streams, random frees."""
    ev: list[Event] = []
    live: list[int] = []
    for ident in range(1, 4000):
        r = rng.random()
        size = rng.randrange(1, 1 * MiB) if r < 0.5 else rng.randrange(1 * MiB, 30 * MiB) if r < 0.9 \
            else rng.randrange(30 * MiB, 400 * MiB)
        ev.append(Alloc(ident, size, rng.choice([0, 0, 0x3000])))
        live.append(ident)
        while len(live) > 20 or (live and rng.random() < 0.4):
            ev.append(Free(live.pop(rng.randrange(len(live)))))
    ev += [Free(i) for i in live]
    return ev


#: Trace kinds, and the device capacity each is made for (bytes).
KINDS: dict[str, tuple[Callable[[random.Random], list[Event]], int]] = {
    "boundaries": (_boundaries, 80 << 30),
    "streams": (_streams, 80 << 30),
    "empty_cache": (_empty_cache, 80 << 30),
    "pressure": (_pressure, 4 << 30),
    "random": (_random, 80 << 30),
}


def make(kind: str, seed: int = 0) -> Trace:
    """The trace of ``kind`` (one of :data:`KINDS`) for ``seed``; its
    ``meta["capacity"]`` is the device size it is made for."""
    if kind not in KINDS:
        raise ValueError(f"unknown adversarial trace {kind!r} (known: {', '.join(KINDS)})")
    build, capacity = KINDS[kind]
    return Trace(events=build(random.Random(f"{kind}:{seed}")),
                 meta={"source": f"adversarial:{kind}:{seed}", "capacity": capacity})
