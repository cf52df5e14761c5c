"""Record real allocation traces with torch on a GPU.

Three small workloads, each in a fresh process with torch's memory history
on (``torch.cuda.memory._record_memory_history(enabled="all", context=None,
max_entries=N)``: no stack traces, so the snapshots stay small):

* ``gpt2-train``: a small GPT-2 (transformers' GPT2Config, random weights)
  trained with AdamW on random tokens for ``--steps`` steps;
* ``cnn-train``: a small ResNet-like conv net (written here) trained with
  SGD under bf16 autocast on random images for ``--steps`` steps;
* ``gpt2-infer``: variable-length inference with the GPT-2: ``--requests``
  requests of random batch size and prompt length, each a prefill plus a
  random number of KV-cached decode steps.

Each snapshot (``torch.cuda.memory._snapshot()``, what ``_dump_snapshot``
pickles) is converted with ``gpumempool.trace.from_torch_snapshot`` into
``NAME.trace.gz`` (gmptrace 1, the format of benchmarks/traces/) and replayed
with ``gpumempool.replay.replay`` (default policy, and expandable=true),
putting our peak reserved next to the one torch recorded. Writes to --out:

    NAME.trace.gz               the traces (copy them to benchmarks/traces/)
    raw/NAME.pickle.gz          torch's snapshots, gzip'ed (--no-keep-snapshots: not kept)
    replay_summary.json / .md   ours vs torch, plus torch's own memory_stats() peak

Needs an NVIDIA GPU, torch with CUDA and transformers; exits with status 2
and says why otherwise. Run on the device machine (tools/gpu-check.sh traces):

    python benchmarks/record_traces.py --out /tmp/traces
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_env  # noqa: E402  (shared GPU checks, next to this script)

MiB = 1 << 20
WORKLOADS = ("gpt2-train", "cnn-train", "gpt2-infer")
#: Recorded only when asked for (benchmarks/tune_proof.py does).
EXTRA_WORKLOADS = ("gpt2-varlen-train",)
POLICIES: dict[str, dict[str, Any]] = {"default": {}, "expandable": {"expandable": True}}


def say(msg: str) -> None:
    print(f"record_traces: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# workers (each in its own process; torch imported only here)
# ---------------------------------------------------------------------------


def _start_history(torch: Any, max_entries: int) -> str:
    rec = torch.cuda.memory._record_memory_history
    try:
        rec(enabled="all", context=None, stacks="python", max_entries=max_entries)
        return "enabled=all, context=None"
    except TypeError:  # an older signature
        rec(enabled="all", max_entries=max_entries)
        return "enabled=all"


def _stop_history(torch: Any) -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:  # noqa: BLE001 - recording is over either way
        pass


def _gpt2(torch: Any, args: argparse.Namespace, n_positions: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=args.vocab, n_positions=n_positions, n_embd=args.embd,
                     n_layer=args.layers, n_head=args.heads)
    return GPT2LMHeadModel(cfg)


def work_gpt2_train(torch: Any, args: argparse.Namespace, dev: Any, notes: dict[str, Any]) -> None:
    model = _gpt2(torch, args, args.seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    notes["workload"] = (f"GPT-2 training: {args.layers} layers, width {args.embd}, {args.heads} heads, vocabulary "
                         f"{args.vocab}; batch {args.batch} x {args.seq} random tokens; {args.steps} AdamW steps")
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 or (step + 1) % 10 == 0:
            say(f"  [gpt2-train] step {step + 1}/{args.steps} loss {float(out.loss):.3f}")


def _resnet(torch: Any, classes: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.short(x))

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32), Block(32, 64, 2), Block(64, 64), Block(64, 128, 2), Block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes),
    )


def work_cnn_train(torch: Any, args: argparse.Namespace, dev: Any, notes: dict[str, Any]) -> None:
    model = _resnet(torch, 100).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    notes["workload"] = (f"ResNet-like CNN (5 residual blocks, 32..256 channels) training: batch {args.cnn_batch} x "
                         f"3x{args.image}x{args.image} random images, bf16 autocast, channels_last, "
                         f"{args.steps} SGD steps")
    for step in range(args.steps):
        x = torch.randn(args.cnn_batch, 3, args.image, args.image, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 100, (args.cnn_batch,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 or (step + 1) % 10 == 0:
            say(f"  [cnn-train] step {step + 1}/{args.steps} loss {float(loss):.3f}")


def work_gpt2_infer(torch: Any, args: argparse.Namespace, dev: Any, notes: dict[str, Any]) -> None:
    import random

    rng = random.Random(args.seed)
    model = _gpt2(torch, args, args.max_len).to(dev).eval()
    decoded = failed = 0
    with torch.inference_mode():
        for r in range(args.requests):
            batch = rng.choice((1, 1, 2, 4, 8))
            new = rng.choice((0, 0, 4, 16, 32))
            prompt = rng.randint(8, args.max_len - new)
            x = torch.randint(0, args.vocab, (batch, prompt), device=dev)
            out = model(input_ids=x, use_cache=new > 0)
            tok = out.logits[:, -1:].argmax(-1)
            if new and failed == 0:
                try:
                    past = out.past_key_values
                    for _ in range(new):
                        out = model(input_ids=tok, past_key_values=past, use_cache=True)
                        past = out.past_key_values
                        tok = out.logits[:, -1:].argmax(-1)
                    decoded += new
                except Exception as exc:  # noqa: BLE001 - an API change: keep prefill-only requests
                    failed += 1
                    notes["decode_error"] = repr(exc)[:300]
                    say(f"  [gpt2-infer] KV-cached decoding failed, prefill only from now on: {exc!r}")
            del out, tok, x
            if (r + 1) % 25 == 0:
                say(f"  [gpt2-infer] request {r + 1}/{args.requests}")
    notes["workload"] = (f"GPT-2 inference ({args.layers} layers, width {args.embd}): {args.requests} requests of "
                         f"random batch (1-8) and prompt length (8-{args.max_len}), prefill then 0-32 KV-cached "
                         f"decode steps ({decoded} decoded tokens in all)")


def work_gpt2_varlen_train(torch: Any, args: argparse.Namespace, dev: Any, notes: dict[str, Any]) -> None:
    """GPT-2 training where every batch has its own shape (batch size and
    sequence length drawn per step, as with unpadded, length-bucketed
    data): activations of ever-different sizes, the classic way to
    fragment a caching allocator."""
    import random

    rng = random.Random(args.seed)
    model = _gpt2(torch, args, args.max_len).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        batch = rng.choice((2, 4, 8, 12, 16))
        seq = rng.randint(16, args.max_len)
        x = torch.randint(0, args.vocab, (batch, seq), device=dev)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 or (step + 1) % 10 == 0:
            say(f"  [gpt2-varlen-train] step {step + 1}/{args.steps} (batch {batch} x {seq}) loss "
                f"{float(out.loss):.3f}")
    notes["workload"] = (f"GPT-2 training with a new shape every step ({args.layers} layers, width {args.embd}): "
                         f"batch 2-16 x 16-{args.max_len} random tokens, {args.steps} AdamW steps")


WORKERS = {"gpt2-train": work_gpt2_train, "cnn-train": work_cnn_train, "gpt2-infer": work_gpt2_infer,
           "gpt2-varlen-train": work_gpt2_varlen_train}


def worker(name: str, args: argparse.Namespace, out_json: Path) -> None:
    """Run workload ``name`` with torch's allocator as PYTORCH_CUDA_ALLOC_CONF
    sets it and write its figures to out_json; with --worker-snapshot, also
    its memory history (recorded while it ran) as a gzip'ed snapshot."""
    import torch

    torch.manual_seed(args.seed)
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    record = bool(args.worker_snapshot)
    notes: dict[str, Any] = {}
    if record:
        notes.update(history=_start_history(torch, args.max_entries), max_entries=args.max_entries)
    t0 = time.perf_counter()
    snap: dict[str, Any] = {}
    try:
        WORKERS[name](torch, args, dev, notes)
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        if record:
            snap = torch.cuda.memory._snapshot()
    finally:
        if record:
            _stop_history(torch)
    entries = sum(len(t) for t in snap.get("device_traces", []))
    if record:
        with gzip.open(Path(args.worker_snapshot), "wb", compresslevel=6) as f:
            pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)
    stats = torch.cuda.memory_stats(dev)
    props = torch.cuda.get_device_properties(dev)
    res = {
        "name": name,
        "seconds": seconds,
        "history_entries": entries,
        "history_overflowed": entries >= args.max_entries,
        "torch_max_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
        "torch_max_memory_reserved": int(torch.cuda.max_memory_reserved(dev)),
        "torch_max_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
        "torch_num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "torch_num_device_alloc": int(stats.get("num_device_alloc", 0)),
        "torch_num_device_free": int(stats.get("num_device_free", 0)),
        "allocator_backend": _gpu_env.allocator_backend(torch),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "",
        "device": props.name,
        "device_total_bytes": int(props.total_memory),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "notes": notes,
    }
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    out_json.write_text(json.dumps(res))


# ---------------------------------------------------------------------------
# the driver (no torch here)
# ---------------------------------------------------------------------------


def gpu_problem() -> Optional[str]:
    """Why this cannot run here, or None (see _gpu_env.gpu_problem)."""
    return _gpu_env.gpu_problem(need_transformers=True)


def run_worker(name: str, args: argparse.Namespace, snapshot: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        res_path = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--worker-out", str(res_path),
               "--worker-snapshot", str(snapshot)] + args.passthrough
        env = dict(os.environ, PYTHONSAFEPATH="1")
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # torch's default allocator: the reference
        env.pop("PYTORCH_ALLOC_CONF", None)
        say(f"== {name}")
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"name": name, "error": f"timed out after {args.timeout} s"}
        if not res_path.exists() or not snapshot.exists():
            return {"name": name, "error": f"worker exited with status {rc} (its output is above)"}
        res = json.loads(res_path.read_text())
        if rc != 0:  # it recorded, then failed on the way out: keep the trace, say so
            say(f"== {name}: exit status {rc} after writing its snapshot (kept, flagged)")
            res["exit_status"] = rc
        say(f"== {name}: {res['history_entries']:,} history entries in {time.perf_counter() - t0:.1f} s")
        return res


def convert_and_replay(name: str, snapshot: Path, info: dict[str, Any], out: Path,
                       max_trace_mib: float = 4.0) -> dict[str, Any]:
    """Import a torch snapshot (pickle, gzip'ed or not) as out/NAME.trace.gz,
    replay it under POLICIES and return the summary row (CPU only)."""
    from gpumempool.replay import replay
    from gpumempool.trace import Trace, from_torch_snapshot

    row: dict[str, Any] = {"name": name, **{k: v for k, v in info.items() if k != "notes"}}
    t0 = time.perf_counter()
    tr = from_torch_snapshot(snapshot)
    tr.validate()
    notes = info.get("notes") or {}
    tr.meta.update({
        "name": name,
        "recorded_with": "torch.cuda.memory._record_memory_history + _snapshot (gpumempool benchmarks/record_traces.py)",
        "date": datetime.date.today().isoformat(),
    })
    for key, meta_key in (("workload", "notes"), ("device", "device"), ("torch", "torch"), ("cuda", "cuda")):
        value = notes.get(key) if key == "workload" else info.get(key)
        if value:
            tr.meta[meta_key] = value
    if info.get("device_total_bytes"):
        tr.meta["capacity"] = int(info["device_total_bytes"])
    if info.get("history_overflowed"):
        tr.meta["history_overflowed"] = True
    path = out / f"{name}.trace.gz"
    tr.save(path)
    back = Trace.load(path)
    assert len(back) == len(tr), "the saved trace reads back differently"
    size = path.stat().st_size
    row.update(
        trace=path.name,
        trace_bytes=size,
        trace_too_big=size > max_trace_mib * MiB,
        events=len(tr),
        counts=tr.counts(),
        import_meta={k: v for k, v in tr.meta.items() if k not in ("notes",)},
        peak_requested=tr.peak_requested(),
        recorded_peak_reserved=tr.recorded_peak_reserved(),
        convert_seconds=time.perf_counter() - t0,
        replay={},
    )
    rec = row["recorded_peak_reserved"]
    if rec and info.get("torch_max_reserved"):
        # the importer's reconstruction of torch's reserved bytes vs torch's own memory_stats() peak
        row["recorded_vs_memory_stats"] = rec / info["torch_max_reserved"]
    for pname, policy in POLICIES.items():
        r = replay(tr, policy)
        d = r.as_dict()
        row["replay"][pname] = {k: d[k] for k in (
            "peak_allocated", "peak_reserved", "fragmentation", "ooms", "skipped", "backend_calls",
            "device_allocs", "device_frees", "cache_hit_rate", "seconds", "recorded_by",
            "recorded_peak_reserved", "reserved_vs_recorded")}
        say(f"  {name} replay ({pname}): ours {r.peak_reserved / MiB:,.1f} MiB vs "
            f"{r.recorded_by or 'recording'} {((r.recorded_peak_reserved or 0) / MiB):,.1f} MiB"
            + (f" -> {r.reserved_vs_recorded:.3f}" if r.reserved_vs_recorded else ""))
    if size > max_trace_mib * MiB:
        say(f"  warning: {path.name} is {size / MiB:.1f} MiB (> {max_trace_mib} MiB): lower --steps/--requests "
            "or --max-entries before shipping it")
    return row


def _mib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / MiB:,.1f}"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def write_summary(doc: dict[str, Any], out: Path) -> None:
    (out / "replay_summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# Recorded traces: gpumempool replay vs torch ({doc.get('device', '?')})",
        "",
        f"{doc['date']}; torch {doc.get('torch', '?')}, CUDA {doc.get('cuda', '?')}, "
        f"gpumempool {doc.get('gpumempool', '?')}. Each trace was recorded with torch's native caching allocator "
        "(`_record_memory_history`, no stacks) and replayed on gpumempool's simulated device; "
        "*ours / torch* < 1 means gpumempool would reserve less for the same requests.",
        "",
        "| trace | events | size | peak requested (MiB) | torch peak reserved (MiB) | torch memory_stats peak (MiB) "
        "| ours, default (MiB) | ours / torch | ours, expandable (MiB) | ours / torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in doc["traces"]:
        if "error" in row:
            lines.append(f"| {row['name']} | error: {str(row['error'])[:120]} | | | | | | | | |")
            continue
        rp = row.get("replay", {})
        dflt, expd = rp.get("default", {}), rp.get("expandable", {})
        lines.append(
            f"| {row['trace']} | {row['events']:,} | {row['trace_bytes'] / MiB:.2f} MiB | {_mib(row['peak_requested'])} "
            f"| {_mib(row.get('recorded_peak_reserved'))} | {_mib(row.get('torch_max_reserved'))} "
            f"| {_mib(dflt.get('peak_reserved'))} | {_ratio(dflt.get('reserved_vs_recorded'))} "
            f"| {_mib(expd.get('peak_reserved'))} | {_ratio(expd.get('reserved_vs_recorded'))} |"
        )
    lines.append("")
    for row in doc["traces"]:
        if "error" in row:
            continue
        extra = []
        if row.get("history_overflowed"):
            extra.append("**history ring overflowed** (raise --max-entries)")
        if row.get("trace_too_big"):
            extra.append("**trace larger than the cap**")
        rvs = row.get("recorded_vs_memory_stats")
        if rvs is not None and abs(rvs - 1) > 1e-9:
            extra.append(f"importer's torch peak / memory_stats peak = {rvs:.4f}")
        lines.append(f"* `{row['trace']}`: {row.get('workload', '')} ({row['history_entries']:,} history entries, "
                     f"{row['seconds']:.1f} s)" + ("; " + "; ".join(extra) if extra else ""))
    (out / "replay_summary.md").write_text("\n".join(lines) + "\n")


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= low (prompts are 8 tokens and up, plus up to 32 decoded)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="record_traces.py",
        description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU, torch and transformers.",
        epilog="Workloads: " + ", ".join(WORKERS) + " (default: " + ", ".join(WORKLOADS) + "). Output: NAME.trace.gz, raw/NAME.pickle.gz, replay_summary.json/.md.",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "traces"),
                    help="output directory (default: benchmarks/traces)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma-separated (default: " + ",".join(WORKLOADS) + ")")
    ap.add_argument("--steps", type=int, default=30, help="training steps of gpt2-train and cnn-train (default 30)")
    ap.add_argument("--requests", type=int, default=100, help="requests of gpt2-infer (default 100)")
    ap.add_argument("--max-entries", type=int, default=1_000_000,
                    help="torch's history ring per workload (default 1000000: gpt2-infer records ~450k "
                         "entries; a trace stays under 4 MiB)")
    ap.add_argument("--max-trace-mib", type=float, default=4.0, help="warn when a trace is larger (default 4)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per workload process (default 240)")
    ap.add_argument("--no-keep-snapshots", action="store_true", help="delete torch's raw snapshots after converting")
    _gpu_env.add_model_args(ap, batch=8, embd=384, heads=6, what="gpt2-train")
    ap.add_argument("--max-len", type=_at_least(40), default=512,
                    help="gpt2-infer longest prompt+decode, at least 40 (default 512)")
    ap.add_argument("--cnn-batch", type=int, default=64, help="CNN batch (default 64)")
    ap.add_argument("--image", type=int, default=96, help="CNN image side in pixels (default 96)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker-snapshot", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    raw_argv = list(argv if argv is not None else sys.argv[1:])
    args.passthrough = []
    skip = False
    for a in raw_argv:  # drop --worker*, --out and their values
        if skip:
            skip = False
            continue
        if a.startswith(("--worker", "--out")):
            skip = "=" not in a
            continue
        args.passthrough.append(a)

    if args.worker:
        worker(args.worker, args, Path(args.worker_out))
        return 0

    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKERS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; valid: {', '.join(WORKERS)}")
    problem = gpu_problem()
    if problem:
        print(f"record_traces: cannot run here: {problem}", file=sys.stderr, flush=True)
        return 2

    import gpumempool as gmp

    out = Path(args.out)
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpumempool": gmp.__version__,
        "config": {k: getattr(args, k) for k in ("steps", "requests", "max_entries", "batch", "seq", "max_len", "vocab",
                                                 "embd", "layers", "heads", "cnn_batch", "image", "seed")},
        "policies": POLICIES,
        "traces": [],
    }
    failed = 0
    for name in names:
        snapshot = raw_dir / f"{name}.pickle.gz"
        info = run_worker(name, args, snapshot)
        if "error" in info:
            say(f"{name}: {info['error']}")
            doc["traces"].append(info)
            failed += 1
            write_summary(doc, out)
            continue
        for key in ("device", "torch", "cuda", "transformers"):
            doc.setdefault(key, info.get(key))
        try:
            row = convert_and_replay(name, snapshot, info, out, args.max_trace_mib)
            row["workload"] = (info.get("notes") or {}).get("workload", "")
            row["snapshot"] = None if args.no_keep_snapshots else f"raw/{snapshot.name}"
            doc["traces"].append(row)
        except Exception as exc:  # noqa: BLE001 - keep the snapshot for debugging the importer on CPU
            import traceback

            traceback.print_exc()
            doc["traces"].append({"name": name, "error": f"conversion/replay failed: {exc!r}",
                                  "snapshot": f"raw/{snapshot.name}", **info})
            failed += 1
            write_summary(doc, out)
            continue
        if args.no_keep_snapshots:
            snapshot.unlink(missing_ok=True)
        write_summary(doc, out)  # after every workload: a stage killed by its time limit keeps what it did
    write_summary(doc, out)
    print((out / "replay_summary.md").read_text())
    say(f"wrote {out}/*.trace.gz and replay_summary.json/.md" + (f"; {failed} workload(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
