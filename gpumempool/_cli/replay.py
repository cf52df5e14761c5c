"""``replay``: a trace on the simulated device under a policy."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Optional

from .._summary import figure_label
from .._units import format_bytes
from . import common


def run(args: argparse.Namespace) -> int:
    import pickle

    from .._progress import Progress
    from ..replay import parse_policy, replay
    from ..trace import TraceFormatError

    try:
        policy = parse_policy(args.policy or [])
    except ValueError as exc:
        return common.fail(f"--policy: {exc}", 2, json_out=args.json)
    if args.capacity is not None:
        policy["capacity"] = args.capacity
    try:
        trace = common.load_trace(args.trace, args)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
        return common.fail(str(exc), json_out=args.json)
    if args.save_trace:
        try:
            trace.save(args.save_trace)
        except OSError as exc:
            return common.fail(f"--save-trace: {exc}", json_out=args.json)
    error: Optional[Exception] = None
    with Progress("replay", unit="ev", enabled=not (args.json or args.no_progress), total=len(trace)) as bar, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            result = replay(trace, policy, progress=bar, recorded_policy=not args.no_recorded_policy,
                            recorded_addresses=not args.no_recorded_addresses, start_state=not args.no_start_state,
                            fraction=args.fraction)
        except (ValueError, TypeError) as exc:
            error = exc
    if error is not None:  # reported once the bar is closed, so that it starts a line of its own
        return common.fail(str(error), 2, json_out=args.json)
    notes = [str(w.message) for w in caught]
    skipped = common.skipped(trace)
    if skipped:
        notes.insert(0, skipped[1])
    for note in notes:  # one line each, as the errors
        print(f"{common.prog()}: warning: {note}", file=sys.stderr)
    if args.json:
        out = result.as_dict()
        out["trace"] = {"path": args.trace, "meta": trace.meta, "counts": trace.counts()}
        out["warnings"] = notes
        common.print_json(out)
        return 0
    pol = ", ".join(f"{k}={v}" + ("" if k in policy else " (recorded)") for k, v in result.policy.items()) or "defaults"
    rows = [
        ("trace", f"{os.path.basename(args.trace)} ({trace.source}, {len(trace):,} events)"),
    ]
    if skipped:
        rows.append(("skipped", skipped[0]))
    rows += [
        ("policy", pol),
        (figure_label("allocations"), f"{result.allocations:,} ({result.ooms:,} OOM)"),
        (figure_label("peak_requested"), format_bytes(result.peak_requested)),
        (figure_label("peak_allocated"), format_bytes(result.peak_allocated)),
        (figure_label("peak_reserved"), format_bytes(result.peak_reserved)),
        (figure_label("fragmentation"), f"{result.fragmentation:.3f} (peak reserved / peak allocated)"),
        (figure_label("backend_calls"), f"{result.backend_calls:,} ({result.device_allocs:,} segment allocations "
                                        f"or growths, {result.device_frees:,} releases)"),
        (figure_label("cache_hit_rate"), f"{100 * result.cache_hit_rate:.2f} %"),
    ]
    if result.recorded_segments:
        rows.append(("segments placed",
                     f"{result.placed_segments:,} of the recording's {result.recorded_segments:,} in its address order"))
    rows[1:1] = _conditions_rows(result, trace)
    if result.recorded_peak_reserved is not None:
        who = result.recorded_by or "recording"
        rows.append((f"{who} peak reserved", format_bytes(result.recorded_peak_reserved)))
        if not result.comparable:
            # peaks of a replay that failed allocations the program made, or
            # that did not meet the recording's memory pressure, differ for
            # that reason alone
            rows.append((f"ours / {who}", f"not comparable: {result.not_comparable_because}"))
        else:
            verdict = "saves memory" if (result.reserved_vs_recorded or 0) < 1 else "no saving"
            rows.append((f"ours / {who}", f"{result.reserved_vs_recorded:.3f} ({verdict})"))
    print("gpumempool replay on the simulated device (sim backend)")
    print(common.table(rows))
    return 0


def _conditions_rows(result: Any, trace: Any) -> list[tuple[str, str]]:
    """Where the replay started and under which memory, for its table."""
    rows = []
    if result.start_segments:
        rows.append(("started mid-run", f"{result.start_segments:,} segments, {format_bytes(result.start_reserved)} "
                                        "reserved at the first event (torch's, rebuilt from the snapshot)"))
    elif result.start_not_seeded:
        rows.append(("started mid-run", f"from an empty device: {result.start_not_seeded}"))
    elif trace.meta.get("start_state_skipped"):
        rows.append(("started mid-run", f"from an empty device: torch's state at the first event could not be "
                                        f"rebuilt ({trace.meta['start_state_skipped']})"))
    source = {"given": "given", "trace": "the trace's", "recording": "inferred from the recording",
              "default": "default"}.get(result.capacity_from, result.capacity_from)
    device = f"{format_bytes(result.capacity)} ({source})"
    if result.policy.get("limit"):
        device += f", limit {format_bytes(result.policy['limit'])}"
    rows.append(("device", device))
    if result.recorded_retries or result.recorded_ooms or result.alloc_retries:
        rows.append(("memory pressure", f"recording: {result.recorded_retries:,} cache releases to retry, "
                                        f"{result.recorded_ooms:,} OOM; replay: {result.alloc_retries:,}, "
                                        f"{result.ooms:,}"))
    return rows


def add_parser(sub: Any) -> None:
    """Add the ``replay`` command to the subparsers ``sub``."""
    from ..replay import POLICY_KEYS

    rep = sub.add_parser(
        "replay",
        help="replay an allocation trace on the simulated device with a policy",
        description="Replay TRACE (a gmptrace file, or a snapshot pickle with history from "
        "torch.cuda.memory._dump_snapshot or gmp.dump_snapshot) on a private simulated device and report "
        "peak allocated/reserved, fragmentation, backend calls and OOMs, next to the reserved bytes the "
        "recording allocator (torch) had. Policy keys (sizes in bytes, with KiB/MiB/GiB or KB/MB/GB "
        "suffixes allowed): " + "; ".join(f"{k}: {v}" for k, v in POLICY_KEYS.items()) + ".",
    )
    rep.add_argument("trace", metavar="TRACE", help="a .trace[.gz] file or a .pickle/.pkl snapshot")
    rep.add_argument("--policy", action="append", metavar="KEY=VALUE",
                     help="a policy setting, e.g. max_split_size=64MiB (repeat, or separate with commas)")
    rep.add_argument("--no-recorded-policy", action="store_true",
                     help="do not apply the recording allocator's settings (torch's max_split_size, "
                     "expandable_segments, roundup_power2_divisions) where --policy leaves them out")
    rep.add_argument("--no-recorded-addresses", action="store_true",
                     help="do not put segments in the address order the recording's device gave them (the "
                     "trace's S records); best fit then breaks ties by the simulated device's own order")
    rep.add_argument("--save-trace", metavar="OUT", help="also write the (imported) trace as a gmptrace file")
    rep.add_argument("--capacity", type=common.size_arg, metavar="BYTES",
                     help="memory of the simulated device (default: the trace's, else what the recording shows "
                     "torch could get where it ran short of memory, else 80GiB)")
    rep.add_argument("--fraction", type=common.fraction_arg, metavar="F",
                     help="limit the replay as torch.cuda.set_per_process_memory_fraction(F) did")
    rep.add_argument("--no-start-state", action="store_true",
                     help="start from an empty device even where the snapshot starts mid-run (by default the "
                     "replay starts with the segments and blocks torch held at the first event)")
    common.trace_input_options(rep)
    rep.set_defaults(func=run)
