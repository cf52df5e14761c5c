"""``demo``: a training-shaped workload on the simulated device."""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import common


def run(args: argparse.Namespace) -> int:
    from .._errors import OutOfMemoryError
    from ..demo import format_summary, run_demo

    try:
        result = run_demo(steps=args.steps, layers=args.layers, seed=args.seed,
                          progress=not args.no_progress and not args.json, snapshot=args.snapshot)
    except OSError as exc:  # --snapshot: a directory, a missing folder, a full disk
        return common.fail(f"--snapshot: {exc}", json_out=args.json)
    except OutOfMemoryError as exc:
        # --layers (weights, activations and gradients per layer) outgrew
        # the demo's 64 GiB simulated device
        return common.fail(f"{exc} (the demo's simulated device has 64 GiB: use fewer --layers)", json_out=args.json)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print("gpumempool demo: training-shaped workload on the simulated device (sim backend)")
        print(format_summary(result))
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``demo`` command to the subparsers ``sub``."""
    demo = sub.add_parser("demo", help="run a training-shaped workload on the simulated device")
    demo.add_argument("--steps", type=common.positive, default=200, help="training steps (default 200)")
    demo.add_argument("--layers", type=common.positive, default=24, help="layers per step (default 24)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--snapshot", metavar="FILE",
                      help="record the pool's history and write its snapshot pickle to FILE (atomically), "
                           "for `plot FILE` and `replay FILE`")
    demo.set_defaults(func=run)
