"""Command line: ``python -m gpumempool {info,demo,replay,tune,oracle,plot,bench}``.

Every command has ``--help``; ``--json`` prints machine-readable output;
long work shows a progress bar on stderr unless ``--json`` or
``--no-progress``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import pickle
import sys
import warnings
import zlib
from typing import Any, Optional, Sequence

from ._summary import figure_label
from ._units import format_bytes


def _cmd_info(args: argparse.Namespace) -> int:
    import gpumempool as gmp

    info = gmp.device_info()
    out = {
        "version": gmp.__version__,
        "library": gmp.library_path(),
        "backends": gmp.backends(),
        "devices": info["devices"],
        "reason": info["reason"],
        "torch": _torch_info(),
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
        # numa_node is the GPU's own NUMA node (its memory is one on Grace
        # Hopper / Blackwell), not the host node nearest a PCIe GPU: -1 there.
        numa = f", GPU is NUMA node {d['numa_node']}" if d["numa_node"] >= 0 else ""
        print(
            f"  [{d['index']}] {d['name']}  {d['uuid']}  {d['total_bytes'] / gib:.1f} GiB total, "
            f"{d['free_bytes'] / gib:.1f} GiB free{numa}, cc {d['compute_capability']}"
        )
    t = out["torch"]
    if t is None:
        print("torch:    not installed (gmp.mempool / set_torch_allocator need it)")
    elif "error" in t:
        print(f"torch:    does not import: {t['error']}")
    else:
        cuda = f"CUDA {t['cuda']}" if t["cuda"] else "no CUDA build"
        print(f"torch:    {t['version']} ({cuda}, GPU {'visible' if t['cuda_available'] else 'not visible'})")
        print(f"  mempool: {t['mempool']}")
        print(f"  full replacement: {'yes' if t['pluggable'] else 'no'}; NCCL registration: {t['nccl_registration']}")
        if t["pluggable"]:
            hooks = t["capabilities"].get("pluggable_hooks") or ()
            graphs = "private pools" if "begin_allocate_to_pool" in hooks else "not isolated (no hooks in this torch)"
            print(f"  full-replacement hooks: {', '.join(hooks) or 'none found'}; CUDA graphs: {graphs}")
            ok, how = t["oom_error_torch"]
            print(f"  oom_error='torch' (torch.OutOfMemoryError): {how if ok else 'unavailable: ' + how}")
    return 0


def _torch_info() -> Any:
    """What gpumempool.torch will do with the installed torch, or None when
    torch is not installed. Imports torch (slow) only when it is there."""
    import importlib.util

    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        from . import torch as gtorch

        caps = gtorch.capabilities(torch)
    except Exception as exc:  # noqa: BLE001 - a broken torch install is reported, not raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not caps.mem_pool:
        mempool = "unsupported (torch < 2.5 has no torch.cuda.MemPool)"
    else:
        enter = "use_mem_pool" if caps.use_mem_pool else f"torch._C.{caps.begin_fn}"
        routing = "this thread only" if caps.thread_local_routing else "every thread while inside (torch 2.5-2.7)"
        mempool = f"torch.cuda.MemPool entered with {enter}; routing: {routing}"
    dist = getattr(torch, "distributed", None)
    pg = getattr(getattr(dist, "distributed_c10d", None), "ProcessGroupNCCL", None) if dist is not None else None
    if pg is None:
        nccl = "unsupported (this torch has no torch.distributed ProcessGroupNCCL)"
    elif hasattr(pg, "register_mem_pool"):
        nccl = "register_mem_pool" + (" (new segments too)" if caps.nccl_registers_new_segments else
                                      " (re-registered on mempool exit)")
    elif hasattr(pg, "_comm_ptr"):
        nccl = "ncclCommRegister per segment"
    else:
        nccl = "unsupported (this torch's ProcessGroupNCCL has neither register_mem_pool nor _comm_ptr)"
    return {
        "version": caps.version,
        "cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "cuda_available": bool(torch.cuda.is_available()),
        "mempool": mempool,
        "pluggable": caps.pluggable,
        "nccl_registration": nccl,
        "oom_error_torch": gtorch.oom_shim_readiness(torch),
        "capabilities": dict(vars(caps)),
    }


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._errors import OutOfMemoryError
    from .demo import format_summary, run_demo

    try:
        result = run_demo(steps=args.steps, layers=args.layers, seed=args.seed,
                          progress=not args.no_progress and not args.json, snapshot=args.snapshot)
    except OSError as exc:  # --snapshot: a directory, a missing folder, a full disk
        return _fail(f"--snapshot: {exc}", json_out=args.json)
    except OutOfMemoryError as exc:
        # --layers (weights, activations and gradients per layer) outgrew
        # the demo's 64 GiB simulated device
        return _fail(f"{exc} (the demo's simulated device has 64 GiB: use fewer --layers)", json_out=args.json)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print("gpumempool demo: training-shaped workload on the simulated device (sim backend)")
        print(format_summary(result))
    return 0


def _file_kind(path: str) -> str:
    """``"trace"`` or ``"snapshot"`` by content (and, for pickles, by
    extension); ValueError naming the file when it is neither."""
    from .trace import is_trace_file

    if is_trace_file(path):
        return "trace"
    with open(path, "rb") as f:
        head = f.read(2)
        if head == b"\x1f\x8b":  # what the gzip holds decides
            f.seek(0)
            try:
                with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                    head = gz.read(8)
            except (OSError, EOFError, zlib.error) as exc:
                raise ValueError(f"{path}: corrupt gzip data: {str(exc)[:200] or type(exc).__name__}") from None
            inner = "gzip data that"
        else:
            inner = "it"
    if head[:1] == b"\x80":
        return "snapshot"
    if path.endswith((".pickle", ".pkl", ".pickle.gz", ".pkl.gz")):
        return "snapshot"  # the safe loader says what is wrong with it
    raise ValueError(f"{path}: neither a gmptrace file nor a snapshot pickle: {inner} starts with {head!r} (a gmptrace "
                     "file starts with 'gmptrace', a snapshot pickle with byte 0x80; --format forces one)")


def _load_trace(path: str, args: argparse.Namespace) -> Any:
    """A gmptrace file (read as a stream: :class:`~gpumempool.trace.TraceFile`),
    or a torch (or gpumempool) snapshot pickle with history."""
    from ._progress import Progress
    from .trace import TraceFile, from_torch_snapshot

    kind = args.format
    if kind == "auto":
        kind = _file_kind(path)
    if kind == "trace":
        # The bar follows the bytes read; it is closed (its line ended) before any error is printed.
        with Progress("load", unit="B", enabled=not (args.json or args.no_progress)) as bar:
            return TraceFile(path, progress=bar)
    return from_torch_snapshot(path, infer_empty_cache=not args.no_infer_empty_cache, lenient=args.lenient)


def _skipped(trace: Any) -> Optional[tuple[str, str]]:
    """What --lenient left out of a snapshot: how many, for a table, and
    the sentence with the first reason; None when nothing."""
    meta = trace.meta
    kinds = (("skipped_events", "malformed event"), ("skipped_segments", "malformed segment"))
    counts = " and ".join(f"{meta[k]:,} {what}{'s' if meta[k] != 1 else ''}" for k, what in kinds if meta.get(k))
    if not counts:  # at most the snapshot's missing segments, taken as none
        first = meta.get("first_skipped")
        return ("no segments (--lenient)", f"--lenient: {first}: taken as none") if first else None
    return f"{counts} (--lenient)", f"--lenient left out {counts}; the first: {meta.get('first_skipped')}"


def _prog() -> str:
    """The command's name as the user typed it: the console script
    ``gpumempool``, else ``python -m gpumempool``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "gpumempool" if name == "gpumempool" else "python -m gpumempool"


def _fail(message: str, code: int = 1, *, json_out: bool = False) -> int:
    """Report an error the usual way (stderr, exit status ``code``); with
    ``json_out``, also print ``{"error": message}`` on stdout, so that a
    ``--json`` caller always gets JSON."""
    print(f"{_prog()}: error: {message}", file=sys.stderr)
    if json_out:
        print(json.dumps({"error": message, "exit_code": code}, indent=2))
    return code


def _finite(obj: Any, depth: int = 0) -> Any:
    """``obj`` with non-finite floats (NaN, infinities: not JSON) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if depth > 64:
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v, depth + 1) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    """Standard JSON only (``json.dumps`` would write NaN and Infinity)."""
    print(json.dumps(_finite(obj), indent=2, allow_nan=False))


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    return "\n".join([line] + [f"| {k.ljust(width)} | {v.ljust(vwidth)} |" for k, v in rows] + [line])


def _cmd_replay(args: argparse.Namespace) -> int:
    import pickle

    from ._progress import Progress
    from .replay import parse_policy, replay
    from .trace import TraceFormatError

    try:
        policy = parse_policy(args.policy or [])
    except ValueError as exc:
        return _fail(f"--policy: {exc}", 2, json_out=args.json)
    if args.capacity is not None:
        policy["capacity"] = args.capacity
    try:
        trace = _load_trace(args.trace, args)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
        return _fail(str(exc), json_out=args.json)
    if args.save_trace:
        try:
            trace.save(args.save_trace)
        except OSError as exc:
            return _fail(f"--save-trace: {exc}", json_out=args.json)
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
        return _fail(str(error), 2, json_out=args.json)
    notes = [str(w.message) for w in caught]
    skipped = _skipped(trace)
    if skipped:
        notes.insert(0, skipped[1])
    for note in notes:  # one line each, as the errors
        print(f"{_prog()}: warning: {note}", file=sys.stderr)
    if args.json:
        out = result.as_dict()
        out["trace"] = {"path": args.trace, "meta": trace.meta, "counts": trace.counts()}
        out["warnings"] = notes
        _print_json(out)
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
    print(_table(rows))
    return 0


def _oom_capacity(trace: Any) -> Optional[int]:
    """The device a recorded run ran out of memory on (the replay's, as
    inferred from the recording), or None when it did not run out."""
    cond = trace.meta.get("recorded_conditions")
    if not trace.meta.get("recorded_ooms") or not isinstance(cond, dict):
        return None
    cap = cond.get("capacity")
    return cap if type(cap) is int and cap > 0 else None


def _oom_rows(trace: Any, result: Any, top: int) -> list[str]:
    """For a run that ran out of memory: whether each setting shown would
    have fit the device it failed on."""
    cap = _oom_capacity(trace)
    if cap is None:
        return []
    lines = [f"would have fit in {format_bytes(cap)} (the device it failed on):"]
    for _, c in result.rows(top):
        conf = f"{result.env_var}={c.alloc_conf}" if c.alloc_conf else \
            ("torch's defaults" if c.alloc_conf == "" else c.describe())
        lines.append(f"  {'yes' if c.fits else 'no '}  {conf}: {format_bytes(c.peak_reserved)} peak reserved"
                     + ("" if c.fits else f", {c.result.ooms:,} allocation(s) fail"))
    return lines


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


def _cmd_oracle(args: argparse.Namespace) -> int:
    from . import oracle
    from .oracle import fidelity
    from .replay import parse_size
    from .trace import TraceFormatError

    try:
        capacity = parse_size(args.capacity) if args.capacity else oracle.DEFAULT_CAPACITY
    except ValueError as exc:
        return _fail(f"--capacity: {exc}", 2, json_out=args.json)
    try:
        trace = _load_trace(args.trace, args)
        if args.compare:
            c = fidelity.compare(trace, args.conf, python=args.python, capacity=capacity, fraction=args.fraction,
                                 devices=args.devices)
        else:
            r = oracle.run(trace, args.conf, python=args.python, capacity=capacity, fraction=args.fraction,
                           devices=args.devices)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError, oracle.OracleError) as exc:
        return _fail(str(exc), json_out=args.json)
    skipped = _skipped(trace)
    if skipped:
        print(f"{_prog()}: warning: {skipped[1]}", file=sys.stderr)
    if args.compare:
        out = {"torch": c.torch_version, "alloc_conf": c.alloc_conf, "matched": c.matched, "total": c.total,
               "first_difference": c.first_difference, "torch_peak_reserved": c.torch_peak_reserved,
               "engine_peak_reserved": c.engine_peak_reserved, "skipped_events": trace.meta.get("skipped_events", 0)}
        if args.json:
            _print_json(out)
        else:
            print(f"torch {c.torch_version} ({args.conf or 'defaults'}) vs the engine: {c.describe()}")
            print(f"peak reserved: torch {format_bytes(c.torch_peak_reserved)}, "
                  f"engine {format_bytes(c.engine_peak_reserved)}")
        return 0 if c.exact else 1
    if args.json:
        d = r.as_dict()
        d["points"] = [list(vars(p).values()) for p in r.points] if args.points else None
        d["skipped_events"] = trace.meta.get("skipped_events", 0)
        _print_json(d)
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
    print(_table(rows))
    return 0


def _tune_limit(text: str) -> Any:
    """--limit: bytes ("40GiB", "42949672960") or, written with a decimal
    point, a fraction of the device ("0.9")."""
    from .replay import parse_size

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
    from .trace import Alloc

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


def _cmd_tune(args: argparse.Namespace) -> int:
    from ._errors import InvalidArgumentError
    from ._progress import Progress
    from .trace import TraceFormatError
    from .tune import tune

    limit = None
    if args.limit is not None:
        try:
            limit = _tune_limit(args.limit)
        except ValueError as exc:
            return _fail(f"--limit: {exc}", 2, json_out=args.json)
    try:
        trace = _load_trace(args.trace, args)
    except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
        return _fail(str(exc), json_out=args.json)
    # a run that ran out of memory: the device it failed on (unless --limit asks about another)
    oom_capacity = _oom_capacity(trace) if limit is None else None
    try:
        with Progress("tune", unit="replay", enabled=not (args.json or args.no_progress)) as bar:
            result = tune(trace, limit=limit, extra=not args.no_extra, jobs=args.jobs, progress=bar,
                          torch_version=args.torch_version, exclude=args.exclude or None,
                          min_capacity=args.min_capacity, min_capacity_rows=min(args.top, 3))
    except InvalidArgumentError as exc:
        return _fail(str(exc), 2, json_out=args.json)
    except (ValueError, TraceFormatError) as exc:
        return _fail(str(exc), json_out=args.json)
    best, default, extra, base = result.best, result.default, result.best_extra, result.baseline
    if args.json:
        out = result.as_dict(n=args.top)
        out["trace"] = {"path": args.trace, "meta": trace.meta}
        if oom_capacity is not None:
            out["out_of_memory"] = {"capacity": oom_capacity,
                                    "fits": {c.alloc_conf if c.alloc_conf is not None else c.describe(): c.fits
                                             for c in result.top(args.top) + [default]}}
        if args.verify:
            from .oracle import FakeStackError, OracleError
            from .oracle.verify import verify

            try:
                out["verify"] = [v.as_dict() for v in verify(result, trace, n=args.verify, python=args.python,
                                                             on=args.verify_on)]
            except (FakeStackError, OracleError, ValueError) as exc:
                return _fail(f"--verify: {exc}", json_out=True)
        _print_json(out)
        return 0 if best.fits else 1
    name = os.path.basename(args.trace)
    stopped = sum(not c.complete for c in result.candidates)
    print(f"gpumempool tune: {name} ({trace.source}, {len(trace):,} events): {result.replays} settings replayed on "
          f"the simulated device in {result.seconds:.1f} s" + (f" ({stopped} stopped early, once they reserved "
                                                                 "a quarter more than the best)" if stopped else ""))
    skipped = _skipped(trace)
    if skipped:
        print(f"note: {skipped[1]}")
    if result.torch_version:
        print(f"modelled torch: {result.torch_version} (only settings the fidelity matrix proved exact against it "
              "are recommended; others are marked unverified)")
    if result.limit is not None:
        how = "" if result.limit_source == "given" else f" ({result.limit_source})"
        print(f"limit {format_bytes(result.limit)}{how} on each device")
    if result.excluded:
        from .tune import TORCH_NAMES

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
    oom = _oom_rows(trace, result, args.top) if oom_capacity is not None else []
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
    from ._progress import Progress
    from .oracle import FakeStackError, OracleError
    from .oracle.verify import verify

    print()
    try:
        with Progress("verify", unit="setting", enabled=not args.no_progress) as bar:
            rows = verify(result, trace, n=args.verify, python=args.python, on=args.verify_on, progress=bar)
    except (FakeStackError, OracleError, ValueError) as exc:
        return _fail(f"--verify: {exc}")
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


def _cmd_plot(args: argparse.Namespace) -> int:
    import pickle

    from ._progress import Progress
    from .plot import MissingDependencyError, require_matplotlib, plot_snapshot
    from .trace import TraceFormatError

    try:  # before the progress bar: nothing can be drawn without it
        require_matplotlib()
    except MissingDependencyError as exc:
        return _fail(str(exc), 2, json_out=args.json)
    if os.path.isdir(args.snapshot):
        return _plot_ranks(args)
    try:
        kind = _file_kind(args.snapshot)
    except (OSError, ValueError) as exc:
        return _fail(str(exc), json_out=args.json)
    if kind == "trace":
        return _fail(f"{args.snapshot} is a gmptrace file; plot reads snapshot pickles "
                     "(gmp.dump_snapshot or torch.cuda.memory._dump_snapshot)", 2, json_out=args.json)
    error: Optional[tuple[str, int]] = None
    with Progress("plot", unit="ev", enabled=not (args.json or args.no_progress)) as bar:
        try:
            summary = plot_snapshot(args.snapshot, args.output, title=args.title,
                                    max_segments=args.max_segments, progress=bar)
        except MissingDependencyError as exc:
            error = (str(exc), 2)
        except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
            error = (str(exc), 1)
    if error is not None:  # reported once the bar is closed, so that it starts a line of its own
        return _fail(error[0], error[1], json_out=args.json)
    if args.json:
        _print_json(summary)
    else:
        print(f"wrote {summary['output']}: {summary['events']:,} history events, {summary['segments']:,} segments, "
              f"{summary['blocks']:,} blocks; {figure_label('peak_requested')} "
              f"{format_bytes(summary['peak_requested'])}, {figure_label('peak_reserved')} "
              f"{format_bytes(summary['peak_reserved'])}")
    return 0


def _plot_ranks(args: argparse.Namespace) -> int:
    """plot DIRECTORY: the ranks' snapshots (gpumempool.distributed.dump_snapshots) side by side."""
    from ._progress import Progress
    from .plot import plot_ranks
    from .trace import TraceFormatError

    error: Optional[str] = None
    with Progress("plot", unit="rank", enabled=not (args.json or args.no_progress)) as bar:
        try:
            summary = plot_ranks(args.snapshot, args.output, title=args.title, progress=bar)
        except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
            error = str(exc)
    if error is not None:
        return _fail(error, json_out=args.json)
    if args.json:
        _print_json(summary)
        return 0
    peak = next(r for r in summary["ranks"] if r["rank"] == summary["peak_rank"])
    print(f"wrote {summary['output']}: {len(summary['ranks'])} ranks side by side; rank {peak['rank']} reserves the "
          f"most ({figure_label('peak_reserved')} {format_bytes(peak['peak_reserved'])}, "
          f"{figure_label('peak_requested')} {format_bytes(peak['peak_requested'])})")
    return 0


#: Where the benchmarks are: a source checkout's, not an installed package's.
BENCH_SCRIPT = "benchmarks/run_all.py"


def _cmd_bench(args: argparse.Namespace) -> int:
    return _fail(f"bench moved out of the package: from a source checkout, run python {BENCH_SCRIPT} "
                 "(--out DIR, --dry-run, --json, --count N as before)", 2, json_out=args.json)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        # argparse would name this function ("invalid _positive value")
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text[:40]!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _size_arg(text: str) -> int:
    from .replay import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0 bytes")
    return value


def _fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text[:40]!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text[:40]!r}")
    return value


def _trace_input_options(cmd: argparse.ArgumentParser) -> None:
    """The options of the commands that read a trace: its format, torch
    snapshots' empty_cache inference and malformed entries, the progress
    bar, JSON output."""
    cmd.add_argument("--format", choices=("auto", "trace", "snapshot"), default="auto",
                     help="input format (default: by extension and content)")
    cmd.add_argument("--no-infer-empty-cache", action="store_true",
                     help="torch snapshots: do not treat released segments outside an allocation as empty_cache()")
    cmd.add_argument("--lenient", action="store_true",
                     help="snapshots: leave out malformed history entries and segments, and say how many, instead "
                     "of refusing the file (a snapshot without history is refused all the same)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument("--json", action="store_true", help="print the result as JSON")


def build_parser() -> argparse.ArgumentParser:
    from .replay import POLICY_KEYS

    parser = argparse.ArgumentParser(prog=_prog(), description="gpumempool command line")
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
    demo.add_argument("--snapshot", metavar="FILE",
                      help="record the pool's history and write its snapshot pickle to FILE (atomically), "
                           "for `plot FILE` and `replay FILE`")
    demo.set_defaults(func=_cmd_demo)

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
    rep.add_argument("--capacity", type=_size_arg, metavar="BYTES",
                     help="memory of the simulated device (default: the trace's, else what the recording shows "
                     "torch could get where it ran short of memory, else 80GiB)")
    rep.add_argument("--fraction", type=_fraction_arg, metavar="F",
                     help="limit the replay as torch.cuda.set_per_process_memory_fraction(F) did")
    rep.add_argument("--no-start-state", action="store_true",
                     help="start from an empty device even where the snapshot starts mid-run (by default the "
                     "replay starts with the segments and blocks torch held at the first event)")
    _trace_input_options(rep)
    rep.set_defaults(func=_cmd_replay)

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
    tun.add_argument("--jobs", type=_positive, help="replays run in parallel (default: the CPU count, at most 8)")
    tun.add_argument("--top", type=_positive, default=5, help="rows of the table (default 5)")
    tun.add_argument("--no-extra", action="store_true", help="only the settings torch accepts")
    tun.add_argument("--verify", type=_positive, nargs="?", const=3, default=0, metavar="N",
                     help="replay the default and the best N (default 3) settings through the installed torch's own "
                     "caching allocator (the GPU if one has room, else a fake CUDA stack built with cc) and print "
                     "predicted and torch's figures side by side")
    tun.add_argument("--python", help="--verify: the Python whose torch judges (default: this one)")
    tun.add_argument("--verify-on", choices=("auto", "gpu", "fake"), default="auto",
                     help="--verify: where torch runs (default auto: the GPU when it has room)")
    tun.add_argument("--torch-version", metavar="X.Y",
                     help="the torch whose allocator to model (default: the installed one, else the newest judged)")
    _trace_input_options(tun)
    tun.set_defaults(func=_cmd_tune)

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
    orc.add_argument("--devices", type=_positive, help="devices (default: as many as the trace uses)")
    orc.add_argument("--compare", action="store_true", help="compare with the engine, event by event")
    orc.add_argument("--points", action="store_true", help="--json: include torch's figures after every event")
    _trace_input_options(orc)
    orc.set_defaults(func=_cmd_oracle)

    plot = sub.add_parser(
        "plot",
        help="plot a memory snapshot: allocated vs reserved over time and a segment map",
        description="Draw SNAPSHOT (a pickle from gmp.dump_snapshot or torch.cuda.memory._dump_snapshot, "
        "loaded without running any code in it) as an image: a timeline of allocated vs reserved bytes "
        "over the recorded history and a map of the segments with their blocks coloured by state. "
        "Needs matplotlib (pip install 'gpumempool[plot]').",
    )
    plot.add_argument("snapshot", metavar="SNAPSHOT",
                      help="snapshot pickle, or a directory of per-rank snapshots (gpumempool.distributed."
                      "dump_snapshots) to draw side by side")
    plot.add_argument("-o", "--output", required=True, metavar="OUT", help="image to write (.png, .svg, .pdf)")
    plot.add_argument("--title", help="figure title")
    plot.add_argument("--max-segments", type=_positive, default=120, help="segments drawn at most (default 120)")
    plot.add_argument("--no-progress", action="store_true", help="no progress bar")
    plot.add_argument("--json", action="store_true", help="print a summary as JSON")
    plot.set_defaults(func=_cmd_plot)

    bench = sub.add_parser(
        "bench",
        help=f"moved: run python {BENCH_SCRIPT} from a source checkout",
        description=f"The benchmarks are a source checkout's: run python {BENCH_SCRIPT} there. "
        "This command only says so.")
    for flag in ("--out", "--root", "--count"):  # the options it had: accepted, so that the one line says it
        bench.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--dry-run", "--json"):
        bench.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ._errors import GpuMemPoolError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`... --json | head`): nothing more to say to
        # it, and nothing for Python to complain about when it flushes stdout
        # at exit. 141 is what a shell reports for SIGPIPE.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError, ArithmeticError, RecursionError, EOFError, pickle.PickleError, zlib.error,
            MemoryError, GpuMemPoolError) as exc:
        # Bad input the command did not report itself, or the library's
        # errors (out of memory, a backend's failure): an error, not a traceback.
        return _fail(f"{type(exc).__name__}: {str(exc)[:500]}", json_out=bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
