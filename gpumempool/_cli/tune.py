"""``tune``: the allocator settings that would have used the least memory for a
recorded run."""

from __future__ import annotations

import argparse
import os
import pickle
from typing import Any

from .._units import format_bytes
from . import common


def _tune_limit(text: str) -> Any:
    """--limit: bytes ("40GiB", "42949672960") or, written with a decimal
    point, a fraction of the device ("0.9")."""
    from ..replay import parse_size

    t = text.strip()
    if "." in t and t.replace(".", "", 1).isdigit():
        value = float(t)
        if not 0 < value <= 1:
            raise ValueError(f"a fraction of the device must be in (0, 1], got {t[:40]!r}")
        return value
    size = parse_size(t)
    if size == 0:
        raise ValueError("must be more than 0 bytes")
    return size


def _oom_site(c: Any, trace: Any) -> str:
    """Where ``c``'s replay first ran out: the event and, where the snapshot
    recorded them, the innermost Python frames (else the innermost named ones)."""
    from ..trace import Alloc

    i = c.first_oom_event
    what = f"event {i:,}"
    events = getattr(trace, "events", None)
    if events is not None and 0 <= i < len(events) and isinstance(events[i], Alloc):
        e = events[i]
        what += f" (alloc {format_bytes(e.size)} on device {e.device}, stream {e.stream})"
    frames = c.first_oom_frames
    shown = [f for f in frames if f["filename"].endswith(".py")] or \
        [f for f in frames if f["filename"] not in ("", "??")]
    if not shown:
        return what + ": the trace holds no recorded stack for it"
    return what + " at " + " < ".join(f"{f['name']} ({os.path.basename(f['filename'])}:{f['line']})"
                                     for f in shown[:4])


def run(args: argparse.Namespace) -> int:
    from .._errors import InvalidArgumentError
    from .._progress import Progress
    from ..trace import TraceFormatError
    from ..tune import tune

    limit = None
    if args.limit is not None:
        try:
            limit = _tune_limit(args.limit)
        except ValueError as exc:
            return common.fail(f"--limit: {exc}", 2, json_out=args.json)
    try:
        trace = common.load_trace(args.trace, args)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
        return common.fail(str(exc), json_out=args.json)
    # a run that ran out of memory: the device it failed on (unless --limit asks about another)
    oom_capacity = common.oom_capacity(trace) if limit is None else None
    try:
        with Progress("tune", unit="replay", enabled=not (args.json or args.no_progress)) as bar:
            result = tune(trace, limit=limit, extra=not args.no_extra, jobs=args.jobs, progress=bar,
                          torch_version=args.torch_version, exclude=args.exclude or None,
                          min_capacity=args.min_capacity, min_capacity_rows=min(args.top, 3))
    except InvalidArgumentError as exc:
        return common.fail(str(exc), 2, json_out=args.json)
    except (ValueError, TraceFormatError) as exc:
        return common.fail(str(exc), json_out=args.json)
    best, default, extra, base = result.best, result.default, result.best_extra, result.baseline
    if args.json:
        out = result.as_dict(n=args.top)
        out["trace"] = {"path": args.trace, "meta": trace.meta}
        if oom_capacity is not None:
            out["out_of_memory"] = {"capacity": oom_capacity,
                                    "fits": {c.alloc_conf if c.alloc_conf is not None else c.describe(): c.fits
                                             for c in result.top(args.top) + [default]}}
        if args.verify:
            from ..oracle import FakeStackError, OracleError
            from ..oracle.verify import verify

            try:
                out["verify"] = [v.as_dict() for v in verify(result, trace, n=args.verify, python=args.python,
                                                             on=args.verify_on)]
            except (FakeStackError, OracleError, ValueError) as exc:
                return common.fail(f"--verify: {exc}", json_out=True)
        common.print_json(out)
        return 0 if best.fits else 1
    name = os.path.basename(args.trace)
    stopped = sum(not c.complete for c in result.candidates)
    print(f"gpumempool tune: {name} ({trace.source}, {len(trace):,} events): {result.replays} settings replayed on "
          f"the simulated device in {result.seconds:.1f} s" + (f" ({stopped} stopped early, once they reserved "
                                                                 "a quarter more than the best)" if stopped else ""))
    skipped = common.skipped(trace)
    if skipped:
        print(f"note: {skipped[1]}")
    if result.torch_version:
        print(f"modelled torch: {result.torch_version} (only settings the fidelity matrix proved exact against it "
              "are recommended; others are marked unverified)")
    if result.limit is not None:
        how = "" if result.limit_source == "given" else f" ({result.limit_source})"
        print(f"limit {format_bytes(result.limit)}{how} on each device")
    if result.excluded:
        from ..tune import TORCH_NAMES

        print(f"excluded from the search: {', '.join(TORCH_NAMES.get(k, k) for k in result.excluded)}")
    for note in result.notes:
        print(f"note: {note}")
    if oom_capacity is not None:
        print(f"out of memory: the run failed on a device with {format_bytes(oom_capacity)} for it (inferred from "
              "the recording: reserved plus free at its oom entry); each setting is replayed on that device, the "
              "request torch could not serve included")
    print()
    rec = result.recorded
    if rec is not None:
        said = f"{result.env_var}={rec.alloc_conf}" if rec.alloc_conf else "torch's defaults"
        print(f"recorded settings: {said}: {format_bytes(rec.peak_reserved)} peak reserved in the replay"
              + ("" if rec.fits else f", {rec.result.ooms:,} allocations fail"))
    saving = base.peak_reserved - best.peak_reserved
    if not best.fits:
        room = (format_bytes(result.limit) if result.limit is not None else
                f"the simulated {format_bytes(best.result.capacity)} device (--limit to set another)")
        print(f"no torch setting fits this run in {room}: the best still fails {best.result.ooms:,} allocations")
    elif best.recorded:
        print("best: the recorded settings already; no setting tried does better")
    elif not best.settings:
        print(f"best: torch's defaults ({format_bytes(best.peak_reserved)} peak reserved); no setting tried does "
              "better")
    if best.fits and not best.recorded and best.settings and not base.fits:
        print(f"best torch setting: {format_bytes(best.peak_reserved)} peak reserved; torch's "
              f"{'defaults' if not base.settings else result.baseline_name + ' settings'} do not fit "
              f"({base.result.ooms:,} allocation(s) fail)")
    elif best.fits and not best.recorded and best.settings:
        print(f"best torch setting: {format_bytes(best.peak_reserved)} peak reserved, "
              f"{best.peak_reserved / base.peak_reserved:.3f} of the {result.baseline_name} settings' "
              f"{format_bytes(base.peak_reserved)} " + (f"(saves {format_bytes(saving)})" if saving >= 0 else
                                                         f"({format_bytes(-saving)} more: they are excluded)"))
    if best.settings:
        print(f"  {result.env_var}={best.alloc_conf}")
        if result.pitfall:
            print(f"  ({result.pitfall})")
        print(f"  {best.mempool_call}")
    left = best.peak_reserved - result.lower_bound
    print(f"lower bound: {format_bytes(result.lower_bound)} (the most bytes the run holds allocated at once; "
          f"{format_bytes(max(0, left))} above it)")
    if result.recorded_peak_reserved is not None:
        print(f"{result.recorded_by or 'the recording'} reserved {format_bytes(result.recorded_peak_reserved)} "
              f"at its peak; the {result.baseline_name} settings' replay: {format_bytes(base.peak_reserved)}")
    if result.limit is not None:
        print(f"with a limit: give torch the same memory, torch.cuda.set_per_process_memory_fraction("
              f"{format_bytes(result.limit)} / total), for the same behaviour")
    print()
    print(result.table(args.top))
    if args.min_capacity:
        print("fits on: the smallest device (per device, to 2 MiB or 1 %) on which the run fits under that setting")
    # the first allocation each failing row cannot serve, once per event
    failing: dict[int, list[tuple[str, Any]]] = {}
    for tag, c in result.rows(args.top):
        if not c.fits and c.first_oom_event is not None:
            failing.setdefault(c.first_oom_event, []).append((tag, c))
    if failing:
        print()
        for rows in failing.values():
            print(f"first OOM of {', '.join(tag for tag, _ in rows)}: {_oom_site(rows[0][1], trace)}")
    oom = common.oom_rows(trace, result, args.top) if oom_capacity is not None else []
    if oom:
        print()
        print("\n".join(oom))
    if args.verify:
        code = _tune_verify(args, result, trace)
        if code:
            return code
    if extra is not None:
        print()
        print(f"gpumempool pools only: {extra.describe()}: {format_bytes(extra.peak_reserved)} "
              f"({extra.peak_reserved / base.peak_reserved:.3f} of the {result.baseline_name} settings, "
              f"{extra.result.backend_calls:,} backend calls)")
        print(f"  {extra.mempool_call}")
    return 0 if best.fits else 1


def _tune_verify(args: argparse.Namespace, result: Any, trace: Any) -> int:
    """tune --verify: the default and the best few settings through torch's
    own allocator, predicted and torch's figures side by side."""
    from .._progress import Progress
    from ..oracle import FakeStackError, OracleError
    from ..oracle.verify import verify

    print()
    try:
        with Progress("verify", unit="setting", enabled=not args.no_progress) as bar:
            rows = verify(result, trace, n=args.verify, python=args.python, on=args.verify_on, progress=bar)
    except (FakeStackError, OracleError, ValueError) as exc:
        return common.fail(f"--verify: {exc}")
    print(f"verified with torch {rows[0].torch_version}'s own caching allocator on the {rows[0].on}:")
    table = [("settings", "predicted peak", "torch peak", "retries (pred/torch)", "OOMs (pred/torch)", "events equal")]
    for v in rows:
        table.append((v.settings, format_bytes(v.predicted_peak), format_bytes(v.torch_peak),
                      f"{v.predicted_retries}/{v.torch_retries}", f"{v.predicted_ooms}/{v.torch_ooms}",
                      f"{v.matched:,}/{v.total:,}" + ("" if v.exact else " (differs)")))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for k, r in enumerate(table):
        print(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("-+-".join("-" * w for w in widths))
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``tune`` command to the subparsers ``sub``."""
    tun = sub.add_parser(
        "tune",
        help="the allocator settings that would have used the least memory for a recorded run",
        description="Replay TRACE (a gmptrace file, or a torch snapshot pickle with history) on the simulated "
        "device under the settings torch's caching allocator accepts (expandable_segments, max_split_size_mb, "
        "roundup_power2_divisions, max_non_split_rounding_mb; garbage_collection_threshold with --limit) and, "
        "listed apart, those only gpumempool's pools accept; print the best as a line for the variable the "
        "modelled torch reads (PYTORCH_ALLOC_CONF from 2.10, PYTORCH_CUDA_ALLOC_CONF before) and as gmp.MemPool "
        "arguments, with a table of the best few, the recorded run's own settings (the baseline), the default "
        "and the lower bound. Exit status 1 when no setting fits in --limit.",
    )
    tun.add_argument("trace", metavar="TRACE", help="a .trace[.gz] file or a .pickle/.pkl snapshot with history")
    tun.add_argument("--limit", metavar="BYTES|FRACTION",
                     help="memory the run may use on each device (e.g. 40GiB), or a fraction of the device (0.9): "
                     "settings that cannot serve it within that are marked and ranked last (default: the device "
                     "the recording ran on, where the snapshot says)")
    tun.add_argument("--exclude", action="append", metavar="OPTION",
                     help="leave an option out of the search (repeat, or separate with commas), e.g. "
                     "expandable_segments where CUDA IPC, NIXL or vLLM's sleep mode cannot use it; torch's names "
                     "or policy keys")
    tun.add_argument("--min-capacity", action="store_true",
                     help="also find the smallest device each of the best few settings (and the recorded ones and "
                     "the default) fits on, by bisection")
    tun.add_argument("--jobs", type=common.positive, help="replays run in parallel (default: the CPU count, at most 8)")
    tun.add_argument("--top", type=common.positive, default=5, help="rows of the table (default 5)")
    tun.add_argument("--no-extra", action="store_true", help="only the settings torch accepts")
    tun.add_argument("--verify", type=common.positive, nargs="?", const=3, default=0, metavar="N",
                     help="replay the default and the best N (default 3) settings through the installed torch's own "
                     "caching allocator (the GPU if one has room, else a fake CUDA stack built with cc) and print "
                     "predicted and torch's figures side by side")
    tun.add_argument("--python", help="--verify: the Python whose torch judges (default: this one)")
    tun.add_argument("--verify-on", choices=("auto", "gpu", "fake"), default="auto",
                     help="--verify: where torch runs (default auto: the GPU when it has room)")
    tun.add_argument("--torch-version", metavar="X.Y",
                     help="the torch whose allocator to model (default: the installed one, else the newest judged)")
    common.trace_input_options(tun)
    tun.set_defaults(func=run)
