"""``bench``: moved out of the package. The benchmarks are a source
checkout's (``benchmarks/run_all.py`` runs those this machine can run); an
installed package has none, so the command only says where they are."""

from __future__ import annotations

import argparse
from typing import Any

from . import common

#: Where the benchmarks are: a source checkout's, not an installed package's.
BENCH_SCRIPT = "benchmarks/run_all.py"


def run(args: argparse.Namespace) -> int:
    return common.fail(f"bench moved out of the package: from a source checkout, run python {BENCH_SCRIPT} "
                       "(--out DIR, --dry-run, --json, --count N as before)", 2, json_out=args.json)


def add_parser(sub: Any) -> None:
    """Add the ``bench`` command to the subparsers ``sub``."""
    bench = sub.add_parser(
        "bench",
        help=f"moved: run python {BENCH_SCRIPT} from a source checkout",
        description=f"The benchmarks are a source checkout's: run python {BENCH_SCRIPT} there. "
        "This command only says so.")
    for flag in ("--out", "--root", "--count"):  # the options it had: accepted, so that the one line says it
        bench.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--dry-run", "--json"):
        bench.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    bench.set_defaults(func=run)
