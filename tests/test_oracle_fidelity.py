"""The engine side of the oracle (gpumempool.oracle.fidelity) without torch:
how a memory fraction becomes a limit in each torch version, and that the
torch version reaches the pool."""

from gpumempool.oracle import fidelity
from gpumempool.trace import Alloc, Free, Trace

GiB, MiB = 1 << 30, 1 << 20


def test_fraction_limit_follows_each_torch_versions_setMemoryFraction() -> None:
    cap = 4 * GiB
    assert fidelity.fraction_limit(cap, None, "2.9.1") is None
    # Up to 2.9: fraction * total, truncated, even at 1.0 (set_fraction is
    # always set, so garbage collection runs at 1.0 too).
    for v in ("2.5.1", "2.9.1", None):
        assert fidelity.fraction_limit(cap, 1.0, v) == cap
        assert fidelity.fraction_limit(cap, 0.8, v) == int(0.8 * cap)
    # From 2.10: no limit at 1.0.
    assert fidelity.fraction_limit(cap, 1.0, "2.11.0") is None
    assert fidelity.fraction_limit(cap, 0.8, "2.11.0") == 3435973836
    # From 2.15: rounded to the nearest byte.
    assert fidelity.fraction_limit(cap, 1.0, "2.15.0+cu130") is None
    assert fidelity.fraction_limit(cap, 0.8, "2.15.0+cu130") == 3435973837


def test_engine_points_take_a_torch_version() -> None:
    # The pool gets the version's rules (MemPool(torch_version=...), whose
    # tie-break test_pool checks) and the version's fraction rule.
    events = [Alloc(1, 40 * MiB), Alloc(2, 40 * MiB), Alloc(3, 40 * MiB), Free(1)]
    trace = Trace(events=events + [Free(2), Alloc(4, 40 * MiB), Free(4), Free(3)])
    for v in (None, "2.11.0", "2.15.0"):
        pts = fidelity.engine_points(trace, capacity=GiB, fraction=1.0, torch_version=v)
        assert len(pts) == len(trace.events)
        assert pts[2].reserved == 120 * MiB and pts[-1].allocated == 0
