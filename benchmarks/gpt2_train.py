"""GPT-2 training inside gmp.mempool vs torch's allocator.

A small GPT-2 (transformers' GPT2Config, random weights, random tokens, a
fixed seed, deterministic kernels) trains for a few hundred steps:

* natively (torch's caching allocator);
* inside ``gmp.mempool(pool, all_threads=True)`` with the ``vmm`` and the
  ``nccl`` backends (all_threads: autograd's backward runs on its own device
  thread, which per-thread routing would leave to torch's allocator);

and reports the losses (must be identical), the median step time ratio vs
native (goal <= 1.02) and the peak reserved ratio vs native (goal <= 1.0;
for a pool: the engine's peak reserved plus whatever torch reserved outside
the pool). After training, the pool's torch pool is released and training
restarts in a new one: the number of raw backend allocations this costs is
reported (0: the engine's cache served it). Finally a ``torch.empty``/``del``
loop runs in full-replacement mode (``gmp.set_torch_allocator``) and
natively (goal <= 1.3x per operation).

Every mode runs in a fresh process (the full replacement must precede CUDA
initialisation; peaks start from zero). Timing on a shared cloud machine
drifts by 10-30 % between processes and even within one run (the step time
of a run alone swings between 25 and 37 ms on an H100 host), so the timed
figures do not come from those runs:

* step time: one more process trains one model per mode (same seed, same
  batches) and alternates them step by step, rotating their order, so every
  mode sees the same machine; the ratio is of the medians of that run;
* the loop: ``--rounds`` processes of each mode, alternated (native,
  replacement, native, ...); each process reports its best of 3 passes and
  the ratio is of the medians over the rounds. Needs an NVIDIA GPU, torch with
CUDA and transformers; run on the device machine:

    python benchmarks/gpt2_train.py [--steps 300] [--out benchmarks/results]

Writes gpt2_<device>.json and gpt2_<device>.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_env  # noqa: E402  (shared GPT-2 options, next to this script)

BANNER = (
    "gpt2_train: GPT-2 training natively and inside gpumempool.mempool (vmm, nccl backends), plus a "
    "full-replacement torch.empty/del loop; needs an NVIDIA GPU, torch with CUDA and transformers"
)
MiB = 1 << 20
TRAIN_MODES = ["native", "mempool-vmm", "mempool-nccl"]
LOOP_MODES = ["loop-native", "loop-replacement"]
INTERLEAVED = "interleaved"  # the timing run of TRAIN_MODES
GOALS = {"step_time_ratio": 1.02, "peak_reserved_ratio": 1.0, "loop_ratio": 1.3}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# workers (each in its own process)
# ---------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        attn_implementation="eager",  # deterministic attention kernels
    )
    try:
        config._attn_implementation = "eager"
    except (AttributeError, ValueError):
        pass
    return GPT2LMHeadModel(config)


def train_step(model: Any, opt: Any, x: Any, dev: Any) -> tuple[float, float]:
    """One timed training step on token batch ``x`` (already on ``dev``):
    returns (loss, seconds). Shared with benchmarks/suite_gpu.py."""
    import torch

    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = float(out.loss.item())  # .item() waits for the step's kernels
    return loss, time.perf_counter() - t0


def warm_up_blas(dev: Any) -> None:
    """Matrix products forward and backward, outside any pool: torch keeps a
    cuBLAS/cuBLASLt workspace per (thread's handle, stream) for the life of
    the process, allocated through its allocator on first use. Made inside
    gmp.mempool it would pin a block of the pool and gmp.torch.release would
    refuse (PoolInUseError)."""
    import torch

    lin = torch.nn.Linear(64, 64).to(dev)
    x = torch.randn(16, 64, device=dev, requires_grad=True)
    y = lin(x)  # addmm with a bias (cuBLASLt)
    z = torch.bmm(y.view(2, 8, 64), y.view(2, 8, 64).transpose(1, 2))  # cuBLAS
    (z.sum() + y.square().sum()).backward()  # mm on autograd's device thread
    torch.cuda.synchronize(dev)


def training_setup(args: argparse.Namespace) -> tuple[Any, Any]:
    """Deterministic kernels without TF32 (the allocator must not change the
    losses) and the run's token batches: (device, batches on the CPU)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(args.seed)
    return torch.device("cuda", 0), torch.randint(0, args.vocab, (args.steps, args.batch, args.seq), generator=g)


def worker_train(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import gpumempool as gmp

    dev, data = training_setup(args)
    pool: Optional[gmp.MemPool] = None
    if mode.startswith("mempool-"):
        pool = gmp.MemPool(mode.split("-", 1)[1], device=0, name=mode)

    def context() -> Any:
        if pool is None:
            import contextlib

            return contextlib.nullcontext()
        return gmp.mempool(pool, device=dev, all_threads=True)

    def outside_pool() -> int:
        """Bytes torch reserved that did not come from the pool."""
        if pool is None:
            return 0
        return max(0, torch.cuda.memory_reserved(dev) - pool.stats(0)["allocated_bytes.all.current"])

    losses: list[float] = []
    times: list[float] = []
    outside_peak = 0
    warm_up_blas(dev)  # every mode, so that they stay comparable
    with context():
        torch.manual_seed(args.seed)
        model = build_model(args).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for step in range(args.steps):
            loss, seconds = train_step(model, opt, data[step].to(dev), dev)
            times.append(seconds)
            losses.append(loss)
            outside_peak = max(outside_peak, outside_pool())
            if (step + 1) % 25 == 0 or step == 0:
                say(f"  [{mode}] step {step + 1}/{args.steps} loss {loss:.4f} {times[-1] * 1e3:.2f} ms")
    res: dict[str, Any] = {
        "mode": mode,
        "losses": losses,
        "step_times_s": times,
        "median_step_s": statistics.median(times[args.warmup:] or times),  # --steps <= --warmup: all of them
        "torch_max_reserved": int(torch.cuda.max_memory_reserved(dev)),
        "torch_max_allocated": int(torch.cuda.max_memory_allocated(dev)),
    }
    if pool is None:
        res["peak_reserved"] = res["torch_max_reserved"]
        return res
    s = pool.stats(0)
    res.update(
        pool_peak_reserved=s["reserved_bytes.all.peak"],
        pool_peak_allocated=s["allocated_bytes.all.peak"],
        outside_pool_peak_reserved=outside_peak,
        peak_reserved=s["reserved_bytes.all.peak"] + outside_peak,
        pool_device_allocs=s["num_device_alloc"],
    )
    # release the torch pool, then train a few steps in a fresh one: served by the engine's cache?
    del model, opt  # train_step kept no references to its outputs
    gc.collect()
    torch.cuda.synchronize(dev)
    res["released_bytes"] = gmp.torch.release(pool)
    n0 = pool.stats(0)["num_device_alloc"]
    t0 = time.perf_counter()
    with context():
        torch.manual_seed(args.seed)
        model = build_model(args).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for step in range(5):
            x = data[step % args.steps].to(dev)
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
    res["reentry_5_steps_s"] = time.perf_counter() - t0
    res["reentry_device_allocs"] = pool.stats(0)["num_device_alloc"] - n0
    say(f"  [{mode}] after release, 5 steps in a new torch pool: {res['reentry_device_allocs']} raw backend allocations")
    del model, opt, out, x
    gc.collect()
    torch.cuda.synchronize(dev)
    gmp.torch.release(pool)
    pool.close()
    return res


def worker_interleaved(modes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One model per mode in this process, trained on the same batches, one
    step of each in turn (the order rotating every step): the step times of
    the modes are comparable because the machine was the same for all."""
    import contextlib

    import torch

    import gpumempool as gmp

    dev, data = training_setup(args)
    warm_up_blas(dev)
    runs: list[dict[str, Any]] = []
    pools: list[Any] = []
    with contextlib.ExitStack() as stack:
        for mode in modes:
            pool = None
            if mode.startswith("mempool-"):
                pool = stack.enter_context(gmp.MemPool(mode.split("-", 1)[1], device=0, name=f"{mode}-interleaved"))
                pools.append(pool)
            ctx = (lambda p=pool: gmp.mempool(p, device=dev, all_threads=True)) if pool is not None \
                else contextlib.nullcontext
            with ctx():
                torch.manual_seed(args.seed)
                model = build_model(args).to(dev)
                opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            # Dropout draws from the generators: each model keeps its own
            # state, as if it trained alone, so that its losses are those of
            # the separate run (one shared state gave every model other masks).
            rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev))
            runs.append({"mode": mode, "ctx": ctx, "model": model, "opt": opt, "rng": rng, "times": [], "losses": []})
        del model, opt  # the runs hold them: dropping the runs frees them
        x = None
        for step in range(args.steps):
            x = data[step].to(dev)
            k = step % len(runs)
            for r in runs[k:] + runs[:k]:
                torch.set_rng_state(r["rng"][0])
                torch.cuda.set_rng_state(r["rng"][1], dev)
                with r["ctx"]():
                    loss, seconds = train_step(r["model"], r["opt"], x, dev)
                r["rng"] = (torch.get_rng_state(), torch.cuda.get_rng_state(dev))
                r["times"].append(seconds)
                r["losses"].append(loss)
            if (step + 1) % 50 == 0 or step == 0:
                say(f"  [{INTERLEAVED}] step {step + 1}/{args.steps}: "
                    + ", ".join(f"{r['mode']} {r['times'][-1] * 1e3:.2f} ms" for r in runs))
        res: dict[str, Any] = {"mode": INTERLEAVED, "modes": modes, "runs": {}}
        for r in runs:
            res["runs"][r["mode"]] = {
                "step_times_s": r["times"],
                "median_step_s": statistics.median(r["times"][args.warmup:] or r["times"]),
                "losses": r["losses"],
            }
        # the pools close (ExitStack) once their tensors are gone and torch gave their segments back
        for r in runs:
            del r["model"], r["opt"]
        runs.clear()
        x = None
        gc.collect()
        torch.cuda.synchronize(dev)
        for pool in pools:
            gmp.torch.release(pool)
    return res


def worker_loop(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch  # CUDA not initialised yet: full replacement is still possible

    import gpumempool as gmp

    pool = None
    if mode == "loop-replacement":
        pool = gmp.MemPool(args.loop_backend, device=0, name="replacement")
        hooks = gmp.set_torch_allocator(pool)
        say(f"  [{mode}] torch's allocator replaced by a {args.loop_backend} pool; hooks wired: {', '.join(hooks)}")
    rng = random.Random(args.seed)
    sizes = [int(2 ** rng.uniform(9, 24)) for _ in range(args.loop_ops)]
    dev = torch.device("cuda", 0)
    res: dict[str, Any] = {"mode": mode, "ops": len(sizes)}
    res.update(_gpu_env.time_alloc_loop(lambda n: torch.empty(n, dtype=torch.uint8, device=dev), sizes,
                                        lambda: torch.cuda.synchronize(dev)))
    for variant in ("empty_del", "window32"):
        say(f"  [{mode}] {variant}: {res[f'{variant}_ns_per_op']:.0f} ns per torch.empty + del")
    if pool is not None:
        res["pool_stats"] = {k: v for k, v in gmp.torch_memory_stats(0).items() if k.endswith(".all.peak") or k.startswith("num_")}
    return res


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


def gpu_problem() -> Optional[str]:
    """Why this cannot run here, or None (see _gpu_env.gpu_problem)."""
    return _gpu_env.gpu_problem(need_transformers=True)


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Za-z]{1,2}\d{2,4})\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")).lower()


def run_worker(mode: str, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--worker-out", str(out)] + args.passthrough
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": str(args.seed)}
        say(f"== {mode}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            say(f"== {mode} FAILED (timed out after {args.timeout} s)")
            return None
        if not out.exists():
            say(f"== {mode} FAILED (exit {proc.returncode})")
            return None
        res = json.loads(out.read_text())
        if proc.returncode != 0:  # it measured, then failed on the way out: keep the numbers, say so
            say(f"== {mode}: exit status {proc.returncode} after writing its result (kept, flagged)")
            res["exit_status"] = proc.returncode
        say(f"== {mode} done in {time.perf_counter() - t0:.1f} s")
        return res


def loop_figures(r: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A loop mode's rounds summed up: the median over its processes of
    each variant's ns/op (None when no round ran)."""
    rounds = (r or {}).get("rounds") or []
    if not rounds:
        return None
    out: dict[str, Any] = {"rounds": len(rounds)}
    for variant in ("empty_del", "window32"):
        values = [x[f"{variant}_ns_per_op"] for x in rounds]
        out[f"{variant}_ns_per_op"] = statistics.median(values)
        out[f"{variant}_all"] = values
    return out


def summarize(results: dict[str, Any], args: argparse.Namespace, device: dict[str, Any], versions: dict[str, str]) -> dict[str, Any]:
    native = results.get("native")
    side = (results.get(INTERLEAVED) or {}).get("runs", {})
    summary: dict[str, Any] = {"train": {}, "loop": {}}
    for mode in TRAIN_MODES[1:]:
        r = results.get(mode)
        if not r or not native:
            continue
        diffs = [abs(a - b) for a, b in zip(r["losses"], native["losses"], strict=False)]
        separate = r["median_step_s"] / native["median_step_s"]
        timed = side.get(mode) and side.get("native")
        summary["train"][mode] = {
            "losses_identical": r["losses"] == native["losses"],
            "max_loss_abs_diff": max(diffs) if diffs else None,
            # the goal's figure: side by side in one process when that ran
            "step_time_ratio": side[mode]["median_step_s"] / side["native"]["median_step_s"] if timed else separate,
            "step_time_from": INTERLEAVED if timed else "separate processes",
            "step_time_ratio_separate": separate,
            "interleaved_losses_identical": side[mode]["losses"] == side["native"]["losses"] if timed else None,
            "peak_reserved_ratio": r["peak_reserved"] / native["peak_reserved"],
            "reentry_device_allocs": r.get("reentry_device_allocs"),
        }
    ln, lr = loop_figures(results.get("loop-native")), loop_figures(results.get("loop-replacement"))
    if ln and lr:
        for variant in ("empty_del", "window32"):
            summary["loop"][variant] = lr[f"{variant}_ns_per_op"] / ln[f"{variant}_ns_per_op"]
        summary["loop"]["native"], summary["loop"]["replacement"] = ln, lr
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "versions": versions,
        "config": {k: getattr(args, k) for k in ("steps", "warmup", "batch", "seq", "vocab", "embd", "layers", "heads", "seed",
                                                 "loop_ops", "loop_backend", "rounds", "interleaved")},
        "goals": GOALS,
        "summary": summary,
        "results": results,
    }


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    res, summ, cfg = doc["results"], doc["summary"], doc["config"]
    ok = lambda v, goal: "yes" if v is not None and v <= goal else "**no**"  # noqa: E731
    side = (res.get(INTERLEAVED) or {}).get("runs", {})
    lines = [
        f"# GPT-2 training with gpumempool.mempool on {doc['device']['name']}",
        "",
        f"{doc['date']}; torch {doc['versions'].get('torch')}, CUDA {doc['versions'].get('cuda')}, "
        f"transformers {doc['versions'].get('transformers')}, gpumempool {doc['versions'].get('gpumempool')}.",
        f"GPT-2 with {cfg['layers']} layers, {cfg['heads']} heads, width {cfg['embd']}, vocabulary {cfg['vocab']}; "
        f"batch {cfg['batch']} x {cfg['seq']} random tokens, {cfg['steps']} AdamW steps, seed {cfg['seed']}, "
        "deterministic kernels. Median step time after "
        f"{cfg['warmup']} warm-up steps. Pools are entered with `gmp.mempool(pool, all_threads=True)`.",
        "",
        "Each mode first trains alone in its own process: its losses (compared with native's), peak reserved "
        "bytes and re-entry cost come from that run. "
        + ("The step times come from one more process that trains one model per mode on the same batches, a "
           "step of each in turn (the order rotating), so that drift of the machine hits every mode alike; "
           "the median of the separate runs is shown for comparison."
           if side else "The step times are the medians of the separate runs (no side-by-side run)."),
        "",
        *([f"**Partial results**: {doc['partial']} ran (the run was cut short).", ""] if doc.get("partial") else []),
        "| mode | median step (ms) | vs native (goal <= 1.02) | separate runs: ms, vs native | peak reserved (MiB) "
        "| vs native (goal <= 1.0) | losses identical | raw allocs on re-entry |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for mode in TRAIN_MODES:
        r = res.get(mode)
        if not r:
            lines.append(f"| {mode} | not run | | | | | | |")
            continue
        s = summ["train"].get(mode, {})
        st, sep, pr = s.get("step_time_ratio"), s.get("step_time_ratio_separate"), s.get("peak_reserved_ratio")
        step_ms = (side.get(mode) or r)["median_step_s"] * 1e3
        same = s.get("losses_identical", "-")
        if s.get("interleaved_losses_identical") is False:
            same = f"{same} (side by side: **False**)"
        lines.append(
            f"| {mode} | {step_ms:.2f} | "
            + (f"{st:.3f} ({ok(st, GOALS['step_time_ratio'])})" if st is not None else "-")
            + f" | {r['median_step_s'] * 1e3:.2f}" + (f", {sep:.3f}" if sep is not None else "")
            + f" | {r['peak_reserved'] / MiB:.0f} | "
            + (f"{pr:.3f} ({ok(pr, GOALS['peak_reserved_ratio'])})" if pr is not None else "-")
            + f" | {same} | {r.get('reentry_device_allocs', '-')} |"
        )
    ln, lr = summ["loop"].get("native"), summ["loop"].get("replacement")
    rounds = (f"{min(ln['rounds'], lr['rounds'])}-{max(ln['rounds'], lr['rounds'])} processes per mode, alternated"
              if ln and lr and ln["rounds"] != lr["rounds"] else
              f"{ln['rounds']} processes per mode, alternated" if ln and lr else f"{cfg.get('rounds')} processes per mode")
    lines += [
        "",
        f"Full replacement (`gmp.set_torch_allocator`, {cfg['loop_backend']} backend): `torch.empty(n)` + `del` "
        f"over {cfg['loop_ops']} sizes from 512 B to 16 MiB; each process takes its best of 3 passes, and the "
        f"figures are the medians over {rounds} (every process's figure in brackets).",
        "",
        "| loop | native (ns/op) | replacement (ns/op) | ratio (goal <= 1.3) |",
        "|---|---:|---:|---:|",
    ]
    for variant, label in (("empty_del", "empty then del"), ("window32", "32 tensors alive")):
        if ln and lr:
            ratio = summ["loop"][variant]
            each = lambda f: ", ".join(f"{v:.0f}" for v in f[f"{variant}_all"])  # noqa: E731
            lines.append(f"| {label} | {ln[f'{variant}_ns_per_op']:.0f} ({each(ln)}) | "
                         f"{lr[f'{variant}_ns_per_op']:.0f} ({each(lr)}) | "
                         f"{ratio:.2f} ({ok(ratio, GOALS['loop_ratio'])}) |")
        else:
            lines.append(f"| {label} | not run | | |")
    path.write_text("\n".join(lines) + "\n")


def write_results(results: dict[str, Any], skipped: dict[str, str], args: argparse.Namespace, dev: dict[str, Any],
                  versions: dict[str, str], caps: Any, partial: str = "") -> tuple[dict[str, Any], Path, str]:
    doc = summarize(results, args, {"name": dev["name"], "uuid": dev.get("uuid"), "total_bytes": dev.get("total_bytes")},
                    versions)
    doc["skipped"] = skipped
    doc["torch_capabilities"] = caps.__dict__
    if partial:
        doc["partial"] = partial
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpt2_{device_slug(dev['name'])}"
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(doc, out_dir / f"{stem}.md")
    return doc, out_dir, stem


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=BANNER,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="steps not timed (default 20)")
    _gpu_env.add_model_args(ap, batch=16, embd=512, heads=8)
    ap.add_argument("--loop-ops", type=int, default=20000, help="torch.empty/del operations of the loop (default 20000)")
    ap.add_argument("--loop-backend", default="cuda", help="gpumempool backend of the full replacement (default cuda)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="processes per loop mode, alternated; the ratio is of their medians (default 3)")
    ap.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                    help="skip the run that times the training modes side by side (the step-time ratio then "
                    "compares separate processes)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per worker process (default 240)")
    ap.add_argument("--modes", default=",".join(TRAIN_MODES + LOOP_MODES),
                    help="comma-separated subset of " + ",".join(TRAIN_MODES + LOOP_MODES))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="results folder (default benchmarks/results)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--worker")]

    if args.worker:
        if args.worker.startswith(INTERLEAVED + ":"):
            res = worker_interleaved(args.worker.split(":", 1)[1].split(","), args)
        else:
            fn = worker_loop if args.worker.startswith("loop-") else worker_train
            res = fn(args.worker, args)
        Path(args.worker_out).write_text(json.dumps(res))
        return 0

    print(BANNER, flush=True)
    problem = gpu_problem()
    if problem:
        print(f"gpt2_train: cannot run here: {problem}", file=sys.stderr, flush=True)
        return 2

    import torch
    import transformers

    import gpumempool as gmp

    dev = gmp.devices()[0]
    versions = {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "gpumempool": gmp.__version__,
        "python": sys.version.split()[0],
    }
    say(f"device: {dev['name']}; {', '.join(f'{k} {v}' for k, v in versions.items())}")
    caps = gmp.torch.capabilities()
    say(f"torch capabilities: {caps}")
    wanted = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    bad = [m for m in wanted if m not in TRAIN_MODES + LOOP_MODES]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}; modes: {', '.join(TRAIN_MODES + LOOP_MODES)}")
    train = [m for m in TRAIN_MODES if m in wanted]
    loops = [m for m in LOOP_MODES if m in wanted]
    planned = len(train) + (1 if args.interleaved and len(train) > 1 else 0) + len(loops) * args.rounds
    done = 0

    def checkpoint() -> None:
        # what has run so far, in case the caller's time limit kills the rest
        if done < planned and "native" in results:
            write_results(results, skipped, args, dev, versions, caps, partial=f"{done} of {planned} runs")

    def run(mode: str) -> Optional[dict[str, Any]]:
        nonlocal done
        r = run_worker(mode, args)
        done += 1
        if r is None:
            skipped[mode.split(":")[0]] = "worker failed (see its output above)"
        return r

    for mode in train:
        if mode.startswith("mempool-"):
            backend = mode.split("-", 1)[1]
            if backend not in gmp.backends():
                skipped[mode] = f"this build has no {backend!r} backend"
                continue
            try:
                gmp.MemPool(backend, device=0).close()
            except gmp.GpuMemPoolError as exc:
                skipped[mode] = f"{backend} backend unavailable: {exc}"
                continue
        if (r := run(mode)) is not None:
            results[mode] = r
        checkpoint()
    side_by_side = [m for m in train if m in results]
    if args.interleaved and len(side_by_side) > 1 and "native" in side_by_side:
        if (r := run(f"{INTERLEAVED}:{','.join(side_by_side)}")) is not None:
            results[INTERLEAVED] = r
        checkpoint()
    for rnd in range(args.rounds):
        # alternate which mode goes first, so that neither always follows the other
        for mode in loops if rnd % 2 == 0 else loops[::-1]:
            if (r := run(mode)) is not None:
                results.setdefault(mode, {"mode": mode, "rounds": []})["rounds"].append(r)
            checkpoint()
    for mode, why in skipped.items():
        say(f"skipped {mode}: {why}")

    doc, out_dir, stem = write_results(results, skipped, args, dev, versions, caps)
    print((out_dir / f"{stem}.md").read_text())
    say(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')}")
    # side by side too: each model keeps its own RNG state there, so its losses are the separate run's
    identical = all(s["losses_identical"] and s.get("interleaved_losses_identical") is not False
                    for s in doc["summary"]["train"].values())
    if not identical:
        say("gpt2_train: losses differ between native and gmp.mempool runs")
    return 0 if identical and not any(v.startswith("worker failed") for v in skipped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
