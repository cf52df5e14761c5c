"""Regenerate demo-synthetic.trace.gz: the demo's training-shaped workload
(gpumempool.demo.run_demo, 200 steps x 24 layers, seed 0) on a sim pool with
history on, converted with gpumempool.trace.from_history.

    python benchmarks/traces/make_synthetic.py

Deterministic: the same gpumempool gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gpumempool as gmp
from gpumempool.demo import run_demo
from gpumempool.trace import from_history

OUT = Path(__file__).resolve().parent / "demo-synthetic.trace.gz"
STEPS, LAYERS, SEED = 200, 24, 0


def main() -> None:
    with gmp.MemPool("sim", name="demo", capacity=64 << 30, manual_events=True) as pool:
        pool.record_history(True, max_entries=1_000_000)
        result = run_demo(steps=STEPS, layers=LAYERS, seed=SEED, progress=False, pool=pool)
        trace = from_history(pool)
    trace.meta.update({
        "synthetic": True,
        "capacity": 64 << 30,  # replay's default device size
        "workload": f"gpumempool.demo.run_demo(steps={STEPS}, layers={LAYERS}, seed={SEED}) on a sim pool "
                    "(capacity 64 GiB, manual events, default policy)",
        "generator": "benchmarks/traces/make_synthetic.py",
    })
    trace.validate()
    trace.save(OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes): {len(trace):,} events, "
          f"peak allocated {result.peak_allocated:,}, peak reserved {result.peak_reserved:,}")


if __name__ == "__main__":
    main()
