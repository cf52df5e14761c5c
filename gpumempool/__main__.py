"""Command line: ``python -m gpumempool {info,demo} [--json]``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    import gpumempool as gmp

    info = gmp.device_info()
    out = {
        "version": gmp.__version__,
        "library": gmp.library_path(),
        "backends": gmp.backends(),
        "devices": info["devices"],
        "reason": info["reason"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"gpumempool {out['version']}")
    print(f"library:  {out['library']}")
    print(f"backends: {', '.join(out['backends'])}")
    if not info["devices"]:
        print(f"devices:  none ({info['reason']})")
    for d in info["devices"]:
        gib = 1 << 30
        print(
            f"  [{d['index']}] {d['name']}  {d['uuid']}  {d['total_bytes'] / gib:.1f} GiB total, "
            f"{d['free_bytes'] / gib:.1f} GiB free, NUMA {d['numa_node']}, cc {d['compute_capability']}"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_summary, run_demo

    result = run_demo(steps=args.steps, layers=args.layers, seed=args.seed, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print("gpumempool demo: training-shaped workload on the simulated device (sim backend)")
        print(format_summary(result))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpumempool", description="gpumempool command line")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, library path and NVIDIA devices (via NVML)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="run a training-shaped workload on the simulated device")
    demo.add_argument("--steps", type=_positive, default=200, help="training steps (default 200)")
    demo.add_argument("--layers", type=_positive, default=24, help="layers per step (default 24)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
