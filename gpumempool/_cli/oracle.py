"""``oracle``: a trace through the installed torch's own caching allocator."""

from __future__ import annotations

import argparse
import pickle
import sys
from typing import Any

from .._units import format_bytes
from . import common


def run(args: argparse.Namespace) -> int:
    from .. import oracle
    from ..oracle import fidelity
    from ..replay import parse_size
    from ..trace import TraceFormatError

    try:
        capacity = parse_size(args.capacity) if args.capacity else oracle.DEFAULT_CAPACITY
    except ValueError as exc:
        return common.fail(f"--capacity: {exc}", 2, json_out=args.json)
    try:
        trace = common.load_trace(args.trace, args)
        if args.compare:
            c = fidelity.compare(trace, args.conf, python=args.python, capacity=capacity, fraction=args.fraction,
                                 devices=args.devices)
        else:
            r = oracle.run(trace, args.conf, python=args.python, capacity=capacity, fraction=args.fraction,
                           devices=args.devices)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError, oracle.OracleError) as exc:
        return common.fail(str(exc), json_out=args.json)
    skipped = common.skipped(trace)
    if skipped:
        print(f"{common.prog()}: warning: {skipped[1]}", file=sys.stderr)
    if args.compare:
        out = {"torch": c.torch_version, "alloc_conf": c.alloc_conf, "matched": c.matched, "total": c.total,
               "first_difference": c.first_difference, "torch_peak_reserved": c.torch_peak_reserved,
               "engine_peak_reserved": c.engine_peak_reserved, "skipped_events": trace.meta.get("skipped_events", 0)}
        if args.json:
            common.print_json(out)
        else:
            print(f"torch {c.torch_version} ({args.conf or 'defaults'}) vs the engine: {c.describe()}")
            print(f"peak reserved: torch {format_bytes(c.torch_peak_reserved)}, "
                  f"engine {format_bytes(c.engine_peak_reserved)}")
        return 0 if c.exact else 1
    if args.json:
        d = r.as_dict()
        d["points"] = [list(vars(p).values()) for p in r.points] if args.points else None
        d["skipped_events"] = trace.meta.get("skipped_events", 0)
        common.print_json(d)
        return 0
    rows = [("skipped", skipped[0])] if skipped else []
    rows += [
        ("torch", f"{r.torch_version} (its own caching allocator, on the fake CUDA stack)"),
        ("settings", f"{r.env_var}={r.alloc_conf}" if r.alloc_conf else "defaults"),
        ("device", format_bytes(r.capacity) + (f", memory fraction {r.fraction}" if r.fraction else "")),
        ("events", f"{len(r.points):,}"),
        ("peak reserved", format_bytes(r.peak_reserved)),
        ("alloc retries", f"{r.retries:,}"),
        ("out of memory", f"{len(r.oom_events):,}" + (f" (first at event {r.oom_events[0]})" if r.oom_events else "")),
    ]
    print(common.table(rows))
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``oracle`` command to the subparsers ``sub``."""
    orc = sub.add_parser(
        "oracle",
        help="replay a trace through the installed torch's own caching allocator (no GPU needed)",
        description="Replay TRACE through the real CUDACachingAllocator of a CUDA build of torch, on a fake CUDA "
        "stack built with cc (no GPU, no kernels: allocation sequences only), and print torch's peak reserved "
        "bytes, retries and out-of-memory errors; with --compare, put the engine's figures beside torch's at "
        "every event (exit status 1 when any differs).",
    )
    orc.add_argument("trace", metavar="TRACE", help="a .trace[.gz] file or a snapshot pickle with history")
    orc.add_argument("--python", help="the Python whose torch judges (default: this one)")
    orc.add_argument("--conf", default="", metavar="CONF",
                     help="torch's allocator settings, e.g. expandable_segments:True,max_split_size_mb:64")
    orc.add_argument("--capacity", metavar="BYTES", help="device size (default 80GiB)")
    orc.add_argument("--fraction", type=float, help="torch.cuda.set_per_process_memory_fraction")
    orc.add_argument("--devices", type=common.positive, help="devices (default: as many as the trace uses)")
    orc.add_argument("--compare", action="store_true", help="compare with the engine, event by event")
    orc.add_argument("--points", action="store_true", help="--json: include torch's figures after every event")
    common.trace_input_options(orc)
    orc.set_defaults(func=run)
