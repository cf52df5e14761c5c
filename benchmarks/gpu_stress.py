"""Multi-threaded stress of the GPU backends (cuda, vmm, vmm-expandable, async)
with every block's contents checked on the GPU.

Per backend a shared pool and one pool per thread; --threads threads with
--streams torch streams each allocate and free random sizes (512 B..--max-mib,
log-uniform) for --seconds, odd threads through the C ABI (ctypes, no GIL),
the others through the Python API. Each block is filled on its stream with its
own tag, and checked on the GPU before it is freed: an overlap, or a reuse
before another stream's work ended, is a verification the GPU did not confirm
(kernels that never ran confirm nothing). At random besides: late rewrites on
another thread's stream + record_stream, blocks freed by another thread,
empty_cache, limits on the shared pool, invariant checks. At the end the stats
must equal the operations done and every pool close clean, with the device's
free memory back. A child process per backend unless --in-process; writes
STEM.json and STEM.md to --out; exit status 1: a goal missed, 2: cannot run.

    python benchmarks/gpu_stress.py --out /tmp/res [--seconds 50 --threads 8]
    compute-sanitizer --tool memcheck --leak-check full \\
        python benchmarks/gpu_stress.py --sanitizer-friendly --out /tmp/res
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import queue
import random
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_env  # noqa: E402  (shared GPU checks, next to this script)

MiB = 1 << 20
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "cuda": ("cuda", {}), "vmm": ("vmm", {}), "vmm-expandable": ("vmm", {"expandable": True}), "async": ("async", {})}
# defaults (normal, --sanitizer-friendly): memcheck slows kernels and the host side alike
MODES = {"seconds": (50.0, 3.0), "threads": (8, 4), "max_mib": (64, 4), "live_mib": (1024, 32)}
ALLOCS, FREES, OOMS, RECORDS, REQUESTED = range(5)  # what this script did, per thread and pool


def say(msg: str) -> None:
    print(f"gpu_stress: {msg}", file=sys.stderr, flush=True)


class Block:
    """A live block: pool index, address, size, stream, tag and the tensors over it."""

    def __init__(self, torch: Any, pool: int, ptr: int, n: int, stream: Any, tag: int) -> None:
        self.pool, self.ptr, self.n, self.stream, self.tag = pool, ptr, n, stream, tag
        self.recorded: set[int] = set()
        # an int32 body, so that tags are unique per block; a byte tail for sizes not a multiple of 4
        self.body = _gpu_env.device_tensor(torch, ptr, n // 4, "int32")
        self.tail = _gpu_env.device_tensor(torch, ptr + n // 4 * 4, n % 4, "uint8") if n % 4 else None

    def fill(self) -> None:
        self.body.fill_(self.tag)
        if self.tail is not None:
            self.tail.fill_(self.tag & 0xFF)

    def holds_tag(self) -> Any:
        ok = self.body.eq(self.tag).all()
        return ok if self.tail is None else ok & self.tail.eq(self.tag & 0xFF).all()


class Ops:
    """A pool's alloc/free/record/empty_cache through the Python API or (lib
    given) the exported C functions: gmp_slot_alloc_ex, gmp_pool_free and the
    slot's torch hooks, whose errors go to pool.last_error()."""

    def __init__(self, pool: Any, lib: Optional[ctypes.CDLL] = None) -> None:
        import gpumempool as gmp

        self.pool, self.lib, self.oom = pool, lib, gmp.OutOfMemoryError
        self.free, self.record, self.empty_cache = pool.free, pool.record_stream, pool.empty_cache
        if lib is not None:
            self.slot = int(pool.pluggable_symbols()[1].rsplit("_", 1)[1])  # gmp_alloc_<slot>
            hooks = pool.pluggable_hooks()
            self.record = getattr(lib, hooks["set_record_stream_fn"])
            self.empty_cache = getattr(lib, hooks["set_reset_fn"])
            self.record.argtypes, self.record.restype = [ctypes.c_size_t, ctypes.c_size_t], None
            self.empty_cache.argtypes, self.empty_cache.restype = [], None
            self.free = self.c_free

    def alloc(self, n: int, stream: int) -> Optional[int]:
        """The block's address, or None when the pool is out of memory."""
        if self.lib is None:
            try:
                return int(self.pool.alloc(n, stream=stream))
            except self.oom:
                return None
        buf, oom = ctypes.create_string_buffer(512), ctypes.c_int(0)
        ptr = self.lib.gmp_slot_alloc_ex(self.slot, n, 0, stream, buf, len(buf), ctypes.byref(oom))
        if ptr or oom.value:
            return ptr or None
        raise RuntimeError(f"gmp_slot_alloc_ex({n}): {buf.value.decode(errors='replace')}")

    def c_free(self, ptr: int) -> None:
        if self.lib is not None and self.lib.gmp_pool_free(self.pool.handle, ptr, 0, 0, 0) != 0:
            raise RuntimeError(f"gmp_pool_free({ptr:#x}): {self.pool.last_error()}")


class Run:
    """One backend's stress: pools, streams, counters, and the threads' body."""

    def __init__(self, torch: Any, name: str, args: argparse.Namespace) -> None:
        import gpumempool as gmp

        self.torch, self.args, self.gmp, n = torch, args, gmp, args.threads
        self.streams = [[torch.cuda.Stream() for _ in range(args.streams)] for _ in range(n)]
        self.main_stream = torch.cuda.Stream()
        every = [self.main_stream] + [s for ss in self.streams for s in ss]
        if len({s.cuda_stream for s in every}) != len(every):  # torch hands out its 32 pooled streams in turn
            raise RuntimeError(f"torch gave the same stream twice among {len(every)}: use fewer --threads/--streams")
        self.good: dict[int, Any] = {}  # stream -> verifications the GPU confirmed, counted on that stream only
        for s in every:
            with torch.cuda.stream(s):
                self.good[s.cuda_stream] = torch.zeros((), dtype=torch.int64, device="cuda")
        self.verified = [0] * (n + 1)  # verifications asked, by thread (the last one: the main thread)
        self.counts = [[[0] * 5 for _ in range(n + 1)] for _ in range(n + 1)]  # [thread][pool][ALLOCS...]
        self.extra = [{"empty_cache": 0, "limits": 0, "handoffs": 0, "bytes_touched": 0} for _ in range(n + 1)]
        self.errors: list[str] = []
        self.violations: list[str] = []
        self.first_bad: Optional[str] = None
        self.handoff: "queue.SimpleQueue[Block]" = queue.SimpleQueue()
        backend, opts = BACKENDS[name]
        self.pools = [gmp.MemPool(backend, name=f"stress-{name}-" + (f"t{i - 1}" if i else "shared"), **opts)
                      for i in range(n + 1)]
        lib = ctypes.CDLL(gmp.library_path())  # the library Python loaded: the same pools
        lib.gmp_slot_alloc_ex.restype = ctypes.c_size_t
        lib.gmp_slot_alloc_ex.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t,
                                          ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
        lib.gmp_pool_free.restype = ctypes.c_int
        lib.gmp_pool_free.argtypes = [ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
        self.py_ops, self.c_ops = [Ops(p) for p in self.pools], [Ops(p, lib) for p in self.pools]
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.seconds

    def ops_of(self, k: int) -> list[Ops]:
        return self.c_ops if k % 2 == 1 and k < self.args.threads else self.py_ops

    def release(self, k: int, blk: Block, stream: Any) -> None:
        """As thread k: check blk's tag on the GPU on stream (after blk's own), and free it."""
        with self.torch.cuda.stream(stream):
            if stream is not blk.stream:
                stream.wait_stream(blk.stream)
            self.good[stream.cuda_stream].add_(blk.holds_tag())
        self.verified[k] += 1
        self.extra[k]["bytes_touched"] += blk.n
        ops = self.ops_of(k)[blk.pool]
        if stream is not blk.stream:
            self.record(k, ops, blk, stream)
        ops.free(blk.ptr)
        self.counts[k][blk.pool][FREES] += 1

    def record(self, k: int, ops: Ops, blk: Block, stream: Any) -> None:
        ops.record(blk.ptr, stream.cuda_stream)
        if stream.cuda_stream not in blk.recorded:  # the engine counts a stream once per block
            blk.recorded.add(stream.cuda_stream)
            self.counts[k][blk.pool][RECORDS] += 1

    def checkpoint(self, k: int, rng: random.Random) -> None:
        """Note when the GPU first did not confirm a tag on thread k's streams; check a pool's invariants."""
        for s in self.streams[k]:
            s.synchronize()  # the counters are read on the default stream
        bad = self.verified[k] - sum(int(self.good[s.cuda_stream].item()) for s in self.streams[k])
        if bad and self.first_bad is None:
            self.first_bad = (f"thread {k}, {time.monotonic() - self.t0:.1f} s in: {bad} of {self.verified[k]} "
                              "verifications not confirmed")
        pool = self.pools[rng.choice((0, k + 1))]
        try:
            pool.check()
        except self.gmp.GpuMemPoolError as exc:
            self.violations.append(f"thread {k}: {pool.name}: {exc}")

    def worker(self, k: int) -> None:
        torch, args = self.torch, self.args
        rng = random.Random(args.seed * 7919 + k)
        mine, own, shared = self.streams[k], (0, k + 1), self.pools[0]
        others = [s for j, ss in enumerate(self.streams) if j != k for s in ss]
        ops, c, x = self.ops_of(k), self.counts[k], self.extra[k]
        live: list[Block] = []
        live_bytes = seq = limit_left = 0
        max_log2, cap = math.log2(args.max_mib * MiB), args.live_mib * MiB
        next_check = time.monotonic() + args.check_every
        sleep = getattr(torch.cuda, "_sleep", None)  # a spin kernel: keeps the late rewrites late
        try:
            while time.monotonic() < self.deadline:
                r = rng.random()
                if r < 0.002:
                    ops[rng.choice(own)].empty_cache()
                    x["empty_cache"] += 1
                elif r < 0.003 and not limit_left:  # around what is reserved: misses release the cache, or OOM
                    reserved = shared.stats()["reserved_bytes.all.current"]
                    shared.set_limit(max(MiB, int(reserved * rng.uniform(0.5, 1.5))))
                    x["limits"] += 1
                    limit_left = 200
                elif limit_left:
                    limit_left -= 1
                    if not limit_left:
                        shared.set_limit(None)
                if live and (live_bytes > cap or rng.random() < 0.45):
                    blk = live.pop(rng.randrange(len(live)))
                    live_bytes -= blk.n
                    if rng.random() < 0.1:
                        self.handoff.put(blk)  # another thread checks and frees it, on its own stream
                        x["handoffs"] += 1
                        continue
                    if rng.random() < 0.25:  # torch's record_stream case: still used elsewhere when freed
                        other = rng.choice(others)
                        with torch.cuda.stream(other):
                            other.wait_stream(blk.stream)
                            if sleep is not None:
                                sleep(rng.randrange(50_000, 1_000_000))
                            blk.fill()  # lands on the next owner's tag if the pool does not wait for `other`
                        self.record(k, ops[blk.pool], blk, other)
                    self.release(k, blk, blk.stream)
                else:
                    n, pi, s = int(2 ** rng.uniform(9, max_log2)), rng.choice(own), rng.choice(mine)
                    ptr = ops[pi].alloc(n, s.cuda_stream)
                    if ptr is None:
                        c[pi][OOMS] += 1
                        continue
                    c[pi][ALLOCS] += 1
                    c[pi][REQUESTED] += n
                    seq += 1
                    blk = Block(torch, pi, ptr, n, s, ((k + 1) << 24) | (seq & 0xFFFFFF))
                    live.append(blk)
                    live_bytes += n
                    with torch.cuda.stream(s):
                        blk.fill()
                    x["bytes_touched"] += n
                if rng.random() < 0.05:
                    try:
                        self.release(k, self.handoff.get_nowait(), rng.choice(mine))
                    except queue.Empty:
                        pass
                if time.monotonic() >= next_check:
                    self.checkpoint(k, rng)
                    next_check = time.monotonic() + args.check_every
        except BaseException as exc:  # noqa: BLE001 - reported; the other threads go on
            self.errors.append(f"thread {k}: {exc!r}\n{traceback.format_exc(limit=6)}")
        finally:
            try:
                if limit_left:
                    shared.set_limit(None)
                while live:
                    blk = live.pop()
                    self.release(k, blk, blk.stream)
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(f"thread {k} freeing its blocks: {exc!r}")

    def close_pool(self, i: int, res: dict[str, Any]) -> None:
        """Pool i after every block was freed: its stats must equal the operations done, its invariants hold,
        and it must empty and close clean."""
        pool = self.pools[i]
        want = [sum(self.counts[t][i][j] for t in range(len(self.counts))) for j in range(5)]
        pool.process_events()
        s = pool.stats()
        res.setdefault("peak_reserved_shared", s["reserved_bytes.all.peak"])
        for key, value in (("allocation.all.allocated", want[ALLOCS]), ("allocation.all.freed", want[FREES]),
                           ("requested_bytes.all.allocated", want[REQUESTED]), ("num_ooms", want[OOMS]),
                           ("num_record_stream", want[RECORDS]), ("allocation.all.current", 0),
                           ("allocated_bytes.all.current", 0), ("active.all.current", 0)):
            if s[key] != value:
                self.violations.append(f"{pool.name}: stats {key} = {s[key]}, the operations done say {value}")
        err = pool.last_error()  # C-ABI failures: an out-of-memory one expected, or none
        if err and not (want[OOMS] and "out of memory" in err.lower()):
            self.errors.append(f"{pool.name}: C ABI error: {err}")
        try:
            pool.check()
        except self.gmp.GpuMemPoolError as exc:
            self.violations.append(f"{pool.name}: {exc}")
        pool.empty_cache()
        if (left := pool.stats()["reserved_bytes.all.current"]) != 0:
            self.violations.append(f"{pool.name}: {left} bytes reserved after every block was freed and empty_cache")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rep = pool.close()
        if rep.live_bytes or caught:
            self.violations.append(f"{pool.name}: close: {rep.live_bytes} live bytes; "
                                   + "; ".join(str(w.message) for w in caught))

    def ops_done(self) -> int:
        return sum(sum(c[:RECORDS + 1]) for t in self.counts for c in t) + sum(
            x["empty_cache"] + x["limits"] + x["handoffs"] for x in self.extra)

    def result(self, res: dict[str, Any], t0: float) -> dict[str, Any]:
        c = [sum(pc[j] for t in self.counts for pc in t) for j in range(5)]
        res.update(operations=self.ops_done(), allocs=c[ALLOCS], frees=c[FREES], ooms=c[OOMS],
                   record_streams=c[RECORDS], requested_bytes=c[REQUESTED], errors=self.errors,
                   violations=self.violations, first_unconfirmed=self.first_bad, wall_s=round(time.monotonic() - t0, 1),
                   **{key: sum(x[key] for x in self.extra) for key in self.extra[0]})
        return res


def run_backend(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Stress one backend in this process: the report's row."""
    import torch
    from gpumempool._progress import Progress

    t0 = time.monotonic()
    torch.cuda.init()
    # torch's streams (made all at once) and the kernels used here (loaded
    # lazily) come before the baseline of free device memory
    with torch.cuda.stream(torch.cuda.Stream()):
        for t in (torch.ones(9, dtype=torch.int32, device="cuda"), torch.ones(9, dtype=torch.uint8, device="cuda")):
            torch.zeros((), dtype=torch.int64, device="cuda").add_(t.fill_(3).eq(3).all() & t.eq(3).all())
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(100)
        del t
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    run = Run(torch, name, args)
    threads = [threading.Thread(target=run.worker, args=(k,), name=f"stress-{k}", daemon=True)
               for k in range(args.threads)]
    for th in threads:
        th.start()
    # past the deadline a thread ends one operation and frees its blocks: a
    # minute later (three under memcheck) it is stuck
    hang_at, tty, said = run.deadline + (180 if args.sanitizer_friendly else 60), sys.stderr.isatty(), time.monotonic()
    with Progress(name, unit="s", enabled=tty, total=int(args.seconds)) as bar:
        while any(th.is_alive() for th in threads) and time.monotonic() < hang_at:
            time.sleep(0.5)
            done = max(0, min(int(args.seconds), int(args.seconds - (run.deadline - time.monotonic()))))
            bar(done, int(args.seconds))
            if not tty and time.monotonic() - said >= 10:
                say(f"{name}: {done} of {args.seconds:g} s, {run.ops_done():,} operations")
                said = time.monotonic()
    res: dict[str, Any] = {"backend": name, "threads": args.threads, "c_abi_threads": args.threads // 2}
    stuck = [th.name for th in threads if th.is_alive()]
    if stuck:  # the pools cannot be torn down under running threads
        run.errors.append(f"{', '.join(stuck)} still running {hang_at - run.deadline:.0f} s after the deadline "
                          "(a deadlock?)")
        return run.result(res, t0)
    try:  # a failure here (a CUDA error, say) keeps the counts above
        run.pools[0].set_limit(None)
        while True:  # the main thread frees what was handed off last
            try:
                run.release(args.threads, run.handoff.get_nowait(), run.main_stream)
            except queue.Empty:
                break
        torch.cuda.synchronize()
        res["verified"] = sum(run.verified)
        res["corrupted"] = res["verified"] - sum(int(t.item()) for t in run.good.values())
        for i in range(len(run.pools)):
            run.close_pool(i, res)
        run.good.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch's temporaries, so that the device's free memory compares
        res["leaked_bytes"] = max(0, free0 - torch.cuda.mem_get_info()[0])
    except Exception as exc:  # noqa: BLE001 - reported as the backend's error
        run.errors.append(f"teardown: {exc!r}\n{traceback.format_exc(limit=6)}")
    return run.result(res, t0)


def run_guarded(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """run_backend, its exception reported as the backend's error."""
    try:
        return run_backend(name, args)
    except Exception as exc:  # noqa: BLE001 - reported, and the next backend runs
        return {"backend": name, "errors": [f"{exc!r}\n{traceback.format_exc(limit=6)}"]}


def goals_missed(r: dict[str, Any], tolerance_mib: Optional[float]) -> list[str]:
    """The goals a backend's row misses (none: it passed)."""
    missed = [f"{len(r[key])} {key}" for key in ("errors", "violations") if r.get(key)]
    if r.get("corrupted") is None:
        missed.append("tags not verified")
    elif r["corrupted"] != 0 or not r.get("verified"):
        missed.append(f"{r['corrupted']} of {r.get('verified')} tag verifications not confirmed by the GPU")
    if tolerance_mib is not None and r.get("leaked_bytes", 0) > tolerance_mib * MiB:
        missed.append(f"device memory {r['leaked_bytes'] / MiB:.1f} MiB short after close")
    return missed


def write_report(doc: dict[str, Any], out: Path, stem: str = "gpu_stress") -> bool:
    """STEM.json and STEM.md; True when every backend met every goal."""
    cfg, tol = doc["config"], doc["config"]["leak_tolerance_mib"]
    mode = ", sanitizer-friendly" if doc["sanitizer_friendly"] else ""
    lines = [f"# GPU stress ({doc['date']}, {doc['device']}{mode})",
             "", (f"torch {doc['torch']}, gpumempool {doc['gpumempool']}; per backend {cfg['seconds']:g} s, "
                  f"{cfg['streams']} streams per thread, sizes 512 B..{cfg['max_mib']} MiB, seed {cfg['seed']}. "
                  "Corrupted: tag verifications the GPU did not confirm. Leaked: device free memory short of the "
                  f"start after close ({'not a goal here' if tol is None else f'goal <= {tol:g} MiB'})."), "",
             ("| backend | threads (C ABI) | seconds | operations | allocs | OOMs | record_stream | GiB touched | "
              "verified | corrupted (goal 0) | violations (goal 0) | leaked MiB | errors (goal 0) | result |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    details, ok = [], bool(doc["backends"])
    num = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
    for name, r in doc["backends"].items():
        r["goals_missed"] = missed = goals_missed(r, tol)
        ok = ok and not missed
        leaked = f"{r['leaked_bytes'] / MiB:.1f}" if "leaked_bytes" in r else "-"
        lines.append(f"| {name} | {r.get('threads', '-')} ({r.get('c_abi_threads', '-')}) | {r.get('wall_s', '-')} | "
                     f"{r.get('operations', 0):,} | {r.get('allocs', 0):,} | {r.get('ooms', 0):,} | "
                     f"{r.get('record_streams', 0):,} | {r.get('bytes_touched', 0) / (1 << 30):,.1f} | "
                     f"{num(r.get('verified'))} | {num(r.get('corrupted'))} | {len(r.get('violations', []))} | "
                     f"{leaked} | {len(r.get('errors', []))} | {'**' + '; '.join(missed) + '**' if missed else 'ok'} |")
        for key in ("errors", "violations"):
            details += [f"* {name}, {key[:-1]}: `{e.splitlines()[0][:300]}`" for e in r.get(key, [])[:10]]
        if r.get("first_unconfirmed"):
            details.append(f"* {name}: first seen at a checkpoint: {r['first_unconfirmed']}")
    doc["ok"] = ok
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{stem}.md").write_text("\n".join(lines + ([""] + details if details else [])) + "\n")
    return ok


def run_child(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """run_backend in a fresh process: a CUDA fault or a hang there spoils only this backend."""
    tmp = out / f".{args.stem}_{name}.json"
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--worker-out", str(tmp)]
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("seconds", "threads", "streams", "seed", "max_mib",
                                                                     "live_mib", "check_every")]
    try:
        rc = subprocess.run(cmd, timeout=args.seconds + 240, check=False).returncode  # start, teardown, the hang wait
    except subprocess.TimeoutExpired:
        return {"backend": name, "errors": ["the worker process was killed: still running 240 s after its deadline"]}
    if not tmp.is_file():
        return {"backend": name, "errors": [f"the worker process exited with status {rc} and no result (see the log)"]}
    res = json.loads(tmp.read_text())
    tmp.unlink()
    return dict(res)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_stress.py", description=__doc__.split("\n\n")[0] + " Needs an NVIDIA GPU.")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output directory")
    ap.add_argument("--stem", default="gpu_stress", help="output file names: STEM.json and STEM.md")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {', '.join(BACKENDS)}")
    ap.add_argument("--seconds", type=float, help="stress time per backend (default 50; sanitizer-friendly 3)")
    ap.add_argument("--threads", type=int, help="threads per backend, at least 2 (default 8; sanitizer-friendly 4)")
    ap.add_argument("--streams", type=int, default=2, help="CUDA streams per thread (default 2)")
    ap.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    ap.add_argument("--max-mib", type=int, help="largest request in MiB (default 64; sanitizer-friendly 4)")
    ap.add_argument("--live-mib", type=int, help="live MiB per thread (default 1024; sanitizer-friendly 32)")
    ap.add_argument("--check-every", type=float, default=1.0, help="seconds between a thread's checkpoints (default 1)")
    ap.add_argument("--leak-tolerance-mib", type=float,
                    help="device memory that may be missing after close (default 64; sanitizer-friendly: not "
                         "checked, memcheck's own device allocations move it, and --leak-check full reports leaks)")
    ap.add_argument("--sanitizer-friendly", action="store_true",
                    help="a short run in this process, for compute-sanitizer --tool memcheck --leak-check full")
    ap.add_argument("--in-process", action="store_true", help="run the backends in this process, one after another")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, (normal, short) in MODES.items():
        if getattr(args, key) is None:
            setattr(args, key, short if args.sanitizer_friendly else normal)
    if args.leak_tolerance_mib is None and not args.sanitizer_friendly:
        args.leak_tolerance_mib = 64.0
    if not 2 <= args.threads or args.threads * args.streams > 31 or min(args.streams, args.max_mib, args.live_mib) < 1 \
            or not 0 < args.seconds < math.inf or not 0 <= args.check_every < math.inf:
        ap.error("--threads must be at least 2 (threads use each other's streams), --threads x --streams at most 31 "
                 "(torch pools 32 streams), --streams, --max-mib and --live-mib at least 1, --seconds more than 0 "
                 "and --check-every at least 0 (both finite)")
    names = [n for n in args.backends.split(",") if n]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        ap.error(f"unknown backend(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(BACKENDS)}")
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_guarded(args.worker, args)))
        sys.stderr.flush()
        os._exit(0)  # threads stuck in the engine (reported) must not keep the process alive
    problem = _gpu_env.gpu_problem()
    if problem:
        say(f"cannot run here: {problem}")
        return 2
    import torch

    import gpumempool as gmp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpumempool": gmp.__version__, "sanitizer_friendly": args.sanitizer_friendly,
        "config": {k: getattr(args, k) for k in ("seconds", "threads", "streams", "seed", "max_mib", "live_mib",
                                                 "leak_tolerance_mib")},
        "backends": {},
    }
    for name in names:
        say(f"{name}: {args.threads} threads ({args.threads // 2} through the C ABI), {args.seconds:g} s")
        in_process = args.in_process or args.sanitizer_friendly
        res = run_guarded(name, args) if in_process else run_child(name, args, out.resolve())
        doc["backends"][name] = res
        ok = write_report(doc, out, args.stem)  # after every backend: a run cut short keeps what ran
        say(f"{name}: {res.get('operations', 0):,} operations, {'; '.join(res['goals_missed']) or 'ok'}")
    print((out / f"{args.stem}.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
