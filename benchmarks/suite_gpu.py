"""GPU benchmark suite: torch's native caching allocator
vs ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` vs gpumempool (context
mode and full replacement) vs CuPy's MemoryPool vs RMM's pool as torch's
allocator.

Configurations, each in a fresh process per workload (full replacement must
precede CUDA initialisation; peaks start from zero):

=============  ===============================================================
native         torch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
async          PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
gmp-context    ``with gmp.mempool(pool, all_threads=True)`` over a ``--backend``
               pool (default cuda): torch caches inside a torch pool whose
               segments come from gpumempool
gmp-replace    ``gmp.set_torch_allocator(pool)``: every CUDA allocation of the
               process is one gpumempool allocation
cupy           CuPy's default MemoryPool (alloc/free loop only)
rmm            RMM's ``PoolMemoryResource`` over ``CudaMemoryResource`` as
               torch's allocator (``rmm.allocators.torch.rmm_torch_allocator``,
               the full-replacement counterpart of gmp-replace), starting
               from ``--rmm-initial-pool`` bytes and growing as RMM does
               (by the larger of the request and the pool). Runs where
               ``import rmm`` works (tools/build-gpu-wheel.sh carries RMM's
               wheels to the device machine); listed as not run otherwise.
=============  ===============================================================

Workloads:

(a) ``loop``: ``torch.empty(n, uint8)`` / ``del`` (``cupy.empty`` for CuPy)
    over ``--loop-ops`` log-uniform sizes from 512 B to 64 MiB, once freeing
    each tensor at once and once keeping the last 32 alive; best of 3 passes
    (ns per allocation + free), then an untimed pass of the 32-alive variant
    measuring the device memory in use (``cudaMemGetInfo`` after every
    allocation) besides the allocator's own peak reserved.
(b) ``gpt2``: the GPT-2 of benchmarks/gpt2_train.py (its ``build_model``,
    imported from the file) trained with AdamW on random tokens: median step
    time after warm-up and peak reserved (for gmp-context: the pool's peak plus
    whatever torch reserved outside it).
(c) ``replay``: ``python -m gpumempool replay TRACE --json`` of every trace in
    --traces (default benchmarks/traces), default policy and expandable=true;
    ours vs the reserved bytes the recording allocator had (torch, for traces
    recorded with benchmarks/record_traces.py). Runs on CPU.

Every figure is reported as a ratio to native torch measured in the same run
(for replays: to torch's recorded peak). Timing on a shared cloud machine
drifts by 10-30 % from one process to the next, so each configuration runs
in ``--rounds`` processes (default 3), the configurations alternating in an
order that rotates every round, and the times reported are the medians over
those processes (each one's figure is kept in the JSON); peaks are the
largest of the rounds. A configuration that fails or times
out is reported as such. Writes suite_gpu_<device>.json, .md and .png
(matplotlib) to --out. Needs an NVIDIA GPU, torch with CUDA, transformers and
CuPy (the cupy configuration is reported as failed without it); only
``--workloads replay`` runs without a GPU. On the device machine:

    python benchmarks/suite_gpu.py --out /tmp/results
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_env  # noqa: E402  (shared GPU checks, next to this script)

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
CONFIGS = ("native", "async", "gmp-context", "gmp-replace", "cupy", "rmm")
WORKLOADS = ("loop", "gpt2", "replay")
REPLAY_POLICIES = {"default": [], "expandable": ["--policy", "expandable=true"]}
GOALS = {"gpt2_step_time": 1.02, "gpt2_peak_reserved": 1.0, "replay_reserved": 1.0}
CONFIG_ENV = {"async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}}


def say(msg: str) -> None:
    print(f"suite_gpu: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# workers (one process per configuration and workload)
# ---------------------------------------------------------------------------


class Env:
    """One configuration, set up in a worker process."""

    def __init__(self, config: str, args: argparse.Namespace) -> None:
        self.config = config
        self.pool: Any = None
        self.gmp: Any = None
        self.torch: Any = None
        self.cp: Any = None
        self.rmm_pool: Any = None
        if config == "cupy":
            import cupy

            self.cp = cupy
            cupy.cuda.Device(0).use()
            self.baseline_free = int(cupy.cuda.runtime.memGetInfo()[0])
            return
        import torch  # CUDA not initialised yet

        import gpumempool as gmp

        self.torch, self.gmp = torch, gmp
        if config == "rmm":
            import rmm
            import rmm.mr
            from rmm.allocators.torch import rmm_torch_allocator

            if rmm_torch_allocator is None:
                raise RuntimeError(f"rmm {rmm.__version__} offers no torch allocator here (torch.cuda unavailable?)")
            self.rmm_version = rmm.__version__
            # Free memory before the pool takes its initial size (RMM's own
            # query: torch's would initialise CUDA before the allocator swap).
            rmm_baseline_free = int(rmm.mr.available_device_memory()[0])
            self.rmm_pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                      initial_pool_size=args.rmm_initial_pool)
            rmm.mr.set_current_device_resource(self.rmm_pool)
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        elif config == "gmp-replace":
            self.pool = gmp.MemPool(args.backend, device=0, name="suite-replace")
            gmp.set_torch_allocator(self.pool)
        elif config == "gmp-context":
            self.pool = gmp.MemPool(args.backend, device=0, name="suite-context")
        self.dev = torch.device("cuda", 0)
        self.baseline_free = int(torch.cuda.mem_get_info(0)[0])
        if config == "rmm":  # the pool's initial size counts as used
            self.baseline_free = max(self.baseline_free, rmm_baseline_free)
        self.allocator_backend = _gpu_env.allocator_backend(torch)

    def context(self) -> Any:
        import contextlib

        if self.config == "gmp-context":
            return self.gmp.mempool(self.pool, device=self.dev, all_threads=True)
        return contextlib.nullcontext()

    def free_bytes(self) -> int:
        if self.cp is not None:
            return int(self.cp.cuda.runtime.memGetInfo()[0])
        return int(self.torch.cuda.mem_get_info(0)[0])

    def sync(self) -> None:
        if self.cp is not None:
            self.cp.cuda.Device(0).synchronize()
        else:
            self.torch.cuda.synchronize(self.dev)

    def peak_reserved(self, outside_peak: int = 0) -> Optional[int]:
        """The allocator's own peak reserved bytes (None: it keeps none, or cannot say)."""
        if self.cp is not None:
            return None  # sampled by the caller
        try:
            if self.config == "rmm":
                return int(self.rmm_pool.pool_size())  # RMM's pool never shrinks: its size now is its peak
            if self.config == "gmp-replace":
                return int(self.gmp.torch_memory_stats(0)["reserved_bytes.all.peak"])
            if self.config == "gmp-context":
                return int(self.pool.stats(0)["reserved_bytes.all.peak"]) + outside_peak
            return int(self.torch.cuda.max_memory_reserved(self.dev))
        except Exception as exc:  # noqa: BLE001 - e.g. an allocator backend without statistics
            say(f"  [{self.config}] no peak reserved figure: {exc!r}")
            return None

    def outside_pool(self) -> int:
        """gmp-context: bytes torch reserved that did not come from the pool."""
        if self.config != "gmp-context":
            return 0
        return max(0, self.torch.cuda.memory_reserved(self.dev) - self.pool.stats(0)["allocated_bytes.all.current"])

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"config": self.config}
        if self.torch is not None:
            d["allocator_backend"] = self.allocator_backend
            d["torch"] = self.torch.__version__
        if self.cp is not None:
            d["cupy"] = self.cp.__version__
        if self.pool is not None:
            d["pool_backend"] = self.pool.config().get("backend")
        if self.rmm_pool is not None:
            d["rmm"] = self.rmm_version
        return d


def loop_sizes(args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed)
    return [int(2 ** rng.uniform(9, 26)) for _ in range(args.loop_ops)]


def worker_loop(env: Env, args: argparse.Namespace) -> dict[str, Any]:
    sizes = loop_sizes(args)
    if env.cp is not None:
        cp = env.cp
        mempool = cp.get_default_memory_pool()

        def make(n: int) -> Any:
            return cp.empty(n, dtype=cp.uint8)

        def reserved_now() -> int:
            return int(mempool.total_bytes())
    else:
        torch, dev = env.torch, env.dev

        def make(n: int) -> Any:
            return torch.empty(n, dtype=torch.uint8, device=dev)

        reserved_now = None  # type: ignore[assignment]
    res: dict[str, Any] = {**env.describe(), "workload": "loop", "ops": len(sizes)}
    with env.context():
        res.update(_gpu_env.time_alloc_loop(make, sizes, env.sync))
        for variant in ("empty_del", "window32"):
            say(f"  [{env.config}] {variant}: {res[f'{variant}_ns_per_op']:.0f} ns per allocation + free")
        # untimed: device memory in use (and CuPy's pool size) after every allocation
        min_free = env.free_bytes()
        sampled = 0
        live = []
        for n in sizes:
            live.append(make(n))
            if len(live) > 32:
                live.pop(0)
            min_free = min(min_free, env.free_bytes())
            if reserved_now is not None:
                sampled = max(sampled, reserved_now())
        live.clear()
        env.sync()
    res["device_used_peak"] = max(0, env.baseline_free - min_free)
    res["peak_reserved"] = sampled if env.cp is not None else env.peak_reserved()
    res["peak_requested_window32"] = _window_peak(sizes, 32)
    return res


def _window_peak(sizes: list[int], window: int) -> int:
    cur = peak = 0
    live: list[int] = []
    for n in sizes:
        live.append(n)
        cur += n
        peak = max(peak, cur)
        if len(live) > window:
            cur -= live.pop(0)
    return peak


def load_gpt2_train() -> Any:
    """benchmarks/gpt2_train.py, next to this file, as a module (its imports
    are stdlib only): the GPT-2 model and training step are its own."""
    path = HERE / "gpt2_train.py"
    spec = importlib.util.spec_from_file_location("gmp_bench_gpt2_train", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker_gpt2(env: Env, args: argparse.Namespace) -> dict[str, Any]:
    if env.cp is not None:
        raise RuntimeError("the GPT-2 workload is a torch workload; not applicable to CuPy")
    torch, dev = env.torch, env.dev
    # deterministic kernels (as benchmarks/gpt2_train.py): the allocator must not change the losses
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq), generator=g)
    times: list[float] = []
    losses: list[float] = []
    outside_peak = 0
    used_peak = 0
    gpt2 = load_gpt2_train()
    source = "benchmarks/gpt2_train.py:build_model"
    with env.context():
        torch.manual_seed(args.seed)
        ns = argparse.Namespace(vocab=args.vocab, seq=args.seq, embd=args.embd, layers=args.layers, heads=args.heads)
        model = gpt2.build_model(ns).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for step in range(args.steps):
            loss, seconds = gpt2.train_step(model, opt, data[step].to(dev), dev)
            times.append(seconds)
            losses.append(loss)
            outside_peak = max(outside_peak, env.outside_pool())
            used_peak = max(used_peak, env.baseline_free - env.free_bytes())
            if step == 0 or (step + 1) % 20 == 0:
                say(f"  [{env.config}] step {step + 1}/{args.steps} loss {loss:.4f} {times[-1] * 1e3:.2f} ms")
    res = {
        **env.describe(),
        "workload": "gpt2",
        "model": source,
        "median_step_s": statistics.median(times[args.warmup:] or times),
        "mean_step_s": statistics.fmean(times[args.warmup:] or times),
        "losses": losses,
        "peak_reserved": env.peak_reserved(outside_peak),
        "outside_pool_peak_reserved": outside_peak if env.config == "gmp-context" else None,
        "device_used_peak_at_step_end": used_peak,
    }
    if env.config in ("native", "async", "gmp-context"):
        try:
            res["torch_max_allocated"] = int(torch.cuda.max_memory_allocated(dev))
        except Exception:  # noqa: BLE001
            pass
    return res


def worker(spec: str, args: argparse.Namespace, out_json: Path) -> None:
    config, workload = spec.split(":", 1)
    env = Env(config, args)
    want = CONFIG_ENV.get(config, {}).get("PYTORCH_CUDA_ALLOC_CONF")
    if want and env.torch is not None and "cudaMallocAsync" in want and env.allocator_backend != "cudaMallocAsync":
        raise RuntimeError(f"PYTORCH_CUDA_ALLOC_CONF={want} but torch's allocator backend is {env.allocator_backend!r}")
    fn = {"loop": worker_loop, "gpt2": worker_gpt2}[workload]
    res = fn(env, args)
    out_json.write_text(json.dumps(res))


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


def gpu_problem() -> Optional[str]:
    """Why this cannot run here, or None (see _gpu_env.gpu_problem)."""
    return _gpu_env.gpu_problem(need_transformers=False)


def _child_env(config: Optional[str] = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    if config is not None:
        env.update(CONFIG_ENV.get(config, {}))
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int, capture: bool = False) -> tuple[Optional[int], str]:
    """Run cmd; (exit status or None on timeout, stdout if captured)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, ""


def run_worker(config: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{config}:{workload}",
               "--worker-out", str(out)] + args.passthrough
        say(f"== {config} / {workload}")
        t0 = time.perf_counter()
        rc, _ = _run(cmd, _child_env(config), args.timeout)
        wall = time.perf_counter() - t0
        if rc is None:
            return {"config": config, "workload": workload, "error": f"timed out after {args.timeout} s"}
        if not out.exists():
            return {"config": config, "workload": workload, "error": f"exit status {rc} (its output is above)"}
        res = json.loads(out.read_text())
        res["wall_s"] = wall
        if rc != 0:  # it measured, then failed on the way out: keep the numbers, say so
            say(f"== {config} / {workload}: exit status {rc} after writing its result (kept, flagged)")
            res["exit_status"] = rc
        say(f"== {config} / {workload} done in {wall:.1f} s")
        return res


def find_traces(dirs: list[str]) -> list[Path]:
    seen: set[Path] = set()
    found: list[Path] = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            continue
        for f in sorted(list(p.glob("*.trace.gz")) + list(p.glob("*.trace"))):
            rp = f.resolve()
            if rp not in seen:
                seen.add(rp)
                found.append(f)
    return found


def run_replays(traces: list[Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for path in traces:
        row: dict[str, Any] = {"trace": path.name, "path": str(path), "policies": {}}
        for pname, extra in REPLAY_POLICIES.items():
            cmd = [sys.executable, "-m", "gpumempool", "replay", str(path), "--json", "--no-progress", *extra]
            t0 = time.perf_counter()
            rc, out = _run(cmd, _child_env(), args.timeout, capture=True)
            if rc != 0:
                row["policies"][pname] = {"error": "timed out" if rc is None else f"exit status {rc}"}
                continue
            try:
                d = json.loads(out)
            except ValueError as exc:
                row["policies"][pname] = {"error": f"unreadable --json output ({exc})"}
                continue
            row["policies"][pname] = {k: d.get(k) for k in (
                "events", "allocations", "ooms", "peak_requested", "peak_allocated", "peak_reserved", "fragmentation",
                "backend_calls", "recorded_by", "recorded_peak_reserved", "reserved_vs_recorded", "comparable")}
            row["policies"][pname]["wall_s"] = time.perf_counter() - t0
            row.setdefault("meta", (d.get("trace") or {}).get("meta", {}))
            r = row["policies"][pname]
            rec = f"{r['recorded_peak_reserved'] / MiB:,.1f} MiB" if r["recorded_peak_reserved"] else "-"
            say(f"  replay {path.name} ({pname}): ours {r['peak_reserved'] / MiB:,.1f} MiB, "
                f"recorded by {r['recorded_by']}: {rec}")
        rows.append(row)
    return rows


TIMED = ("empty_del_ns_per_op", "window32_ns_per_op", "median_step_s", "mean_step_s")
PEAKS = ("peak_reserved", "device_used_peak", "device_used_peak_at_step_end", "outside_pool_peak_reserved",
         "torch_max_allocated")


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's processes (rounds) as one result: the first
    one's fields, times replaced by their median over the rounds (each
    round's in <key>_all), peaks by their largest; failed rounds are listed
    in round_errors, and all of them failing is the first one's error."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return dict(rounds[0])
    res = dict(ok[0])
    res["rounds"] = len(ok)
    for k in TIMED:
        values = [r[k] for r in ok if r.get(k) is not None]
        if values:
            res[k] = statistics.median(values)
            res[f"{k}_all"] = values
    for k in PEAKS:
        values = [r[k] for r in ok if r.get(k) is not None]
        if values:
            res[k] = max(values)
    if "losses" in res:
        res["losses_same_every_round"] = all(r.get("losses") == res["losses"] for r in ok)
    errors = [r["error"] for r in rounds if "error" in r]
    if errors:
        res["round_errors"] = errors
    return res


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b:
        return None
    return a / b


def summarize(results: dict[str, dict[str, Any]], replays: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios to native torch (same run) for loop and gpt2; ours / recorded for replays."""
    summary: dict[str, Any] = {"loop": {}, "gpt2": {}, "replay": {}}
    nl = results.get("native:loop")
    ng = results.get("native:gpt2")
    for config in CONFIGS:
        r = results.get(f"{config}:loop")
        if r and "error" not in r and nl and "error" not in nl:
            summary["loop"][config] = {
                "empty_del_time": _ratio(r.get("empty_del_ns_per_op"), nl.get("empty_del_ns_per_op")),
                "window32_time": _ratio(r.get("window32_ns_per_op"), nl.get("window32_ns_per_op")),
                "peak_reserved": _ratio(r.get("peak_reserved"), nl.get("peak_reserved")),
                "device_used_peak": _ratio(r.get("device_used_peak"), nl.get("device_used_peak")),
            }
        r = results.get(f"{config}:gpt2")
        if r and "error" not in r and ng and "error" not in ng:
            summary["gpt2"][config] = {
                "step_time": _ratio(r.get("median_step_s"), ng.get("median_step_s")),
                "peak_reserved": _ratio(r.get("peak_reserved"), ng.get("peak_reserved")),
                "losses_identical_to_native": r.get("losses") == ng.get("losses"),
            }
    for row in replays:
        summary["replay"][row["trace"]] = {
            # a replay with OOMs held less than the program: its ratio is no saving
            p: v.get("reserved_vs_recorded") for p, v in row["policies"].items()
            if "error" not in v and not v.get("ooms")
        }
    return summary


def _f(v: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _goal(v: Optional[float], goal: float) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" + ("" if v <= goal else " **(goal <= %g)**" % goal)


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    res, summ, cfg = doc["results"], doc["summary"], doc["config"]
    lines = [
        f"# GPU allocator suite on {doc.get('device', '?')}",
        "",
        f"{doc['date']}; torch {doc['versions'].get('torch', '?')}, CUDA {doc['versions'].get('cuda', '?')}, "
        f"CuPy {doc['versions'].get('cupy', '?')}, RMM {doc['versions'].get('rmm', '-')}, "
        f"gpumempool {doc['versions'].get('gpumempool', '?')}; "
        f"gpumempool pools use the `{cfg['backend']}` backend. Each configuration ran in "
        f"{cfg.get('rounds', 1)} processes of its own, alternating with the others; times are medians over those "
        "processes, peaks the largest; ratios are to native torch in this run (< 1: less time or memory).",
    ]
    if doc.get("partial"):
        lines += ["", f"**Partial results**: {doc['partial']} (the run was cut short; these are the runs that ended)."]
    has = {w: any(k.endswith(":" + w) for k in res) for w in ("loop", "gpt2")}
    if has["loop"]:
        lines += [
            "",
            f"## (a) alloc/free loop: {cfg['loop_ops']:,} sizes, 512 B - 64 MiB (log-uniform), best of 3",
            "",
            "| configuration | empty+del ns/op | ratio | 32 alive ns/op | ratio | peak reserved MiB | ratio "
            "| device used peak MiB | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for c in doc["configs"]:
        r = res.get(f"{c}:loop")
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {c} | failed: {r['error'][:100]} | | | | | | | |")
            continue
        s = summ["loop"].get(c, {})
        lines.append(
            f"| {c} | {_f(r.get('empty_del_ns_per_op'), '{:,.0f}')} | {_f(s.get('empty_del_time'))} "
            f"| {_f(r.get('window32_ns_per_op'), '{:,.0f}')} | {_f(s.get('window32_time'))} "
            f"| {_f(None if r.get('peak_reserved') is None else r['peak_reserved'] / MiB, '{:,.1f}')} "
            f"| {_f(s.get('peak_reserved'))} "
            f"| {_f(r['device_used_peak'] / MiB, '{:,.1f}')} | {_f(s.get('device_used_peak'))} |"
        )
    if has["gpt2"]:
        lines += [
            "",
            f"## (b) GPT-2 training: {cfg['layers']} layers, width {cfg['embd']}, batch {cfg['batch']} x {cfg['seq']}, "
            f"{cfg['steps']} AdamW steps (median after {cfg['warmup']})",
            "",
            "| configuration | median step ms | ratio (goal <= 1.02) | peak reserved MiB | ratio (goal <= 1.0) "
            "| losses identical to native |",
            "|---|---:|---:|---:|---:|---|",
        ]
    for c in doc["configs"]:
        r = res.get(f"{c}:gpt2")
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {c} | failed: {r['error'][:100]} | | | | |")
            continue
        s = summ["gpt2"].get(c, {})
        lines.append(
            f"| {c} | {r['median_step_s'] * 1e3:.2f} | {_goal(s.get('step_time'), GOALS['gpt2_step_time'])} "
            f"| {_f(None if r.get('peak_reserved') is None else r['peak_reserved'] / MiB, '{:,.1f}')} "
            f"| {_goal(s.get('peak_reserved'), GOALS['gpt2_peak_reserved'])} "
            f"| {s.get('losses_identical_to_native', '-')} |"
        )
    if doc["replays"]:
        lines += [
            "",
            "## (c) trace replays on the simulated device (`python -m gpumempool replay`)",
            "",
            "| trace | recorded by | events | recorded peak reserved MiB | ours, default MiB | ours / recorded "
            "| ours, expandable MiB | ours / recorded |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in doc["replays"]:
            d = row["policies"].get("default", {})
            e = row["policies"].get("expandable", {})
            if "error" in d:
                lines.append(f"| {row['trace']} | failed: {d['error']} | | | | | | |")
                continue
            torch_rec = d.get("recorded_by") == "torch"
            ratio = (lambda v: _goal(v, GOALS["replay_reserved"])) if torch_rec else _f
            lines.append(
                f"| {row['trace']} | {d.get('recorded_by') or '-'} | {d.get('events') or 0:,} "
                f"| {_f(None if not d.get('recorded_peak_reserved') else d['recorded_peak_reserved'] / MiB, '{:,.1f}')} "
                f"| {_f(d['peak_reserved'] / MiB, '{:,.1f}')} | {ratio(d.get('reserved_vs_recorded'))} "
                f"| {_f(None if 'peak_reserved' not in e else e['peak_reserved'] / MiB, '{:,.1f}')} "
                f"| {ratio(e.get('reserved_vs_recorded'))} |"
            )
        lines.append("")
        lines.append("Goal: ours / torch <= 1.0 on every trace recorded by torch; traces recorded by "
                     "gpumempool itself show a policy's effect, not a comparison with torch.")
    failed_rounds = {k: r["round_errors"] for k, r in res.items() if r.get("round_errors")}
    if failed_rounds:
        lines += ["", "Rounds that failed (the figures above are from the others): " + "; ".join(
            f"{k}: {len(v)} ({v[0][:80]})" for k, v in failed_rounds.items())]
    if doc.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in doc["skipped"].items())]
    path.write_text("\n".join(lines) + "\n")


def write_chart(doc: dict[str, Any], path: Path) -> Optional[str]:
    """One PNG: ratios to native torch per configuration, and replay ratios. Returns an error or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable ({exc})"
    summ = doc["summary"]
    metrics: list[tuple[str, Callable[[str], Optional[float]]]] = [
        ("loop time (empty+del)", lambda c: summ["loop"].get(c, {}).get("empty_del_time")),
        ("loop time (32 alive)", lambda c: summ["loop"].get(c, {}).get("window32_time")),
        ("loop peak reserved", lambda c: summ["loop"].get(c, {}).get("peak_reserved")),
        ("loop device used", lambda c: summ["loop"].get(c, {}).get("device_used_peak")),
        ("GPT-2 step time", lambda c: summ["gpt2"].get(c, {}).get("step_time")),
        ("GPT-2 peak reserved", lambda c: summ["gpt2"].get(c, {}).get("peak_reserved")),
    ]
    configs = [c for c in doc["configs"] if c != "native"]
    replays = doc["replays"]
    fig, axes = plt.subplots(1, 2 if replays else 1, figsize=(15 if replays else 10, 5.5),
                             gridspec_kw={"width_ratios": [2, 1]} if replays else None, squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        vals = [m(c) for _, m in metrics]
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(metrics))]
        ax.bar([x for x, v in zip(xs, vals) if v is not None], [v for v in vals if v is not None], width,
               label=c if any(v is not None for v in vals) else f"{c} (no data)", color=f"C{CONFIGS.index(c)}")
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xticks(range(len(metrics)))
    ax.set_xticklabels([n for n, _ in metrics], rotation=20, ha="right")
    ax.set_ylabel("ratio to native torch (lower is better)")
    ax.set_title(f"Allocators vs torch native ({doc.get('device', '?')})")
    ax.legend(fontsize=8)
    if replays:
        ax2 = axes[0][1]
        names = [r["trace"].replace(".trace.gz", "") for r in replays]
        for i, pol in enumerate(REPLAY_POLICIES):
            vals = [r["policies"].get(pol, {}).get("reserved_vs_recorded") for r in replays]
            xs = [j + (i - 0.5) * 0.4 for j in range(len(replays))]
            ax2.bar([x for x, v in zip(xs, vals) if v is not None], [v for v in vals if v is not None], 0.4,
                    label=f"gpumempool {pol}", color=f"C{len(CONFIGS) + i}")
        ax2.set_xlim(-0.8, len(replays) - 0.2)
        ax2.axhline(1.0, color="black", lw=1, ls="--")
        ax2.set_xticks(range(len(replays)))
        ax2.set_xticklabels(names, rotation=20, ha="right")
        ax2.set_ylabel("peak reserved / recorded")
        ax2.set_title("Trace replays (sim) vs recording allocator")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def device_slug(name: str) -> str:
    m = re.search(r"\b([A-Za-z]{1,2}\d{2,4})\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "cpu").lower()


def versions() -> dict[str, str]:
    v: dict[str, str] = {"python": sys.version.split()[0]}
    for mod in ("gpumempool", "torch", "cupy", "transformers", "rmm"):
        try:
            m = __import__(mod)
            v[mod] = str(getattr(m, "__version__", "?"))
            if mod == "torch":
                v["cuda"] = str(m.version.cuda)
        except Exception:  # noqa: BLE001
            pass
    return v


def build_doc(args: argparse.Namespace, configs: list[str], device: str, results: dict[str, dict[str, Any]],
              replays: list[dict[str, Any]], skipped: dict[str, str], vers: dict[str, str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "versions": vers,
        "config": {k: getattr(args, k) for k in ("backend", "rounds", "loop_ops", "rmm_initial_pool", "steps", "warmup", "batch",
                                                 "seq", "vocab", "embd", "layers", "heads", "seed", "timeout")},
        "configs": configs,
        "goals": GOALS,
        "summary": summarize(results, replays),
        "results": results,
        "replays": replays,
        "skipped": skipped,
    }


def write_outputs(doc: dict[str, Any], out: Path, chart: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"suite_gpu_{device_slug(doc.get('device') or 'cpu')}"
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    err = write_chart(doc, paths[2]) if chart else "no chart for partial results"
    if err:
        doc["chart_error"] = err
        paths.pop()
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(doc, paths[1])
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="suite_gpu.py",
        description="GPU allocator suite: torch native vs cudaMallocAsync vs gpumempool (context mode, full "
        "replacement) vs CuPy's MemoryPool, on an alloc/free loop, GPT-2 training and trace replays. "
        "Needs an NVIDIA GPU, torch, transformers and CuPy (only --workloads replay runs without a GPU).",
        epilog=f"Configurations: {', '.join(CONFIGS)}. Workloads: {', '.join(WORKLOADS)}.",
    )
    ap.add_argument("--out", default=str(HERE / "results"), help="output directory (default: benchmarks/results)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset (native always runs)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of loop,gpt2,replay")
    ap.add_argument("--traces", action="append", metavar="DIR",
                    help="directory of *.trace.gz to replay (repeatable; default benchmarks/traces)")
    ap.add_argument("--backend", default="cuda", help="gpumempool backend of gmp-context/gmp-replace (default cuda)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per worker process (default 240)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="processes per configuration and GPU workload, alternated; times are their medians (default 3)")
    ap.add_argument("--loop-ops", type=int, default=20000)
    ap.add_argument("--rmm-initial-pool", type=int, default=2 * MiB,
                    help="bytes RMM's pool starts with (a multiple of 256; default 2 MiB)")
    ap.add_argument("--steps", type=int, default=60, help="GPT-2 training steps (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="GPT-2 steps not timed (default 10)")
    _gpu_env.add_model_args(ap, batch=16, embd=512, heads=8)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    raw_argv = list(argv if argv is not None else sys.argv[1:])
    args.passthrough, skip = [], False
    for a in raw_argv:  # drop --worker*, --out, --traces and their values
        if skip:
            skip = False
            continue
        if a.startswith(("--worker", "--out", "--traces")):
            skip = "=" not in a
            continue
        args.passthrough.append(a)

    if args.worker:
        worker(args.worker, args, Path(args.worker_out))
        return 0

    configs = [c for c in args.configs.split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [c for c in configs if c not in CONFIGS] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown configuration/workload {', '.join(bad)}; configurations: {', '.join(CONFIGS)}; "
                 f"workloads: {', '.join(WORKLOADS)}")
    if "native" not in configs:
        configs.insert(0, "native")  # every figure is a ratio to it
    skipped: dict[str, str] = {}
    if "rmm" in configs and importlib.util.find_spec("rmm") is None:
        configs.remove("rmm")
        skipped["rmm"] = "rmm is not installed (tools/build-gpu-wheel.sh puts its wheels in wheelhouse/rmm)"
    gpu_work = [w for w in workloads if w != "replay"]
    device = "cpu"
    if gpu_work:
        problem = gpu_problem()
        if problem:
            print(f"suite_gpu: cannot run here: {problem}", file=sys.stderr, flush=True)
            return 2
        import gpumempool as gmp

        device = gmp.devices()[0]["name"]
    vers = versions()
    say(f"device: {device}; " + ", ".join(f"{k} {v}" for k, v in vers.items()))

    results: dict[str, dict[str, Any]] = {}
    runs: list[tuple[str, str]] = []
    for rnd in range(args.rounds):
        for w in gpu_work:
            # rotate the order, so that no configuration always runs first or after the same one
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            runs += [(c, w) for c in order if not (w == "gpt2" and c == "cupy")]
    if "gpt2" in gpu_work and "cupy" in configs:
        skipped["cupy:gpt2"] = "torch workload; not applicable to CuPy"
    each: dict[str, list[dict[str, Any]]] = {}
    for i, (config, workload) in enumerate(runs, 1):
        key = f"{config}:{workload}"
        each.setdefault(key, []).append(run_worker(config, workload, args))
        results[key] = combine_rounds(each[key])
        # what has run so far, in case the caller's time limit kills the rest
        doc = build_doc(args, configs, device, results, [], skipped, vers)
        doc["partial"] = f"{i} of {len(runs)} GPU runs" + (" (trace replays not run yet)" if "replay" in workloads else "")
        write_outputs(doc, Path(args.out), chart=False)
    replays: list[dict[str, Any]] = []
    if "replay" in workloads:
        dirs = args.traces or [str(HERE / "traces")]
        traces = find_traces(dirs)
        if not traces:
            skipped["replay"] = f"no *.trace.gz in {', '.join(dirs)}"
        replays = run_replays(traces, args)

    doc = build_doc(args, configs, device, results, replays, skipped, vers)
    paths = write_outputs(doc, Path(args.out))
    print(paths[1].read_text())
    say("wrote " + ", ".join(str(p) for p in paths))
    failed = [k for k, r in results.items() if "error" in r or r.get("round_errors")]
    failed += [f"replay {r['trace']}" for r in replays if any("error" in v for v in r["policies"].values())]
    if failed:
        say("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
