#!/usr/bin/env python3
"""The real-torch tests against every minor release of torch from 2.5 on, on
the fake CUDA stack, as tests/test_torch_versions.py runs them for three in
CI: slim installs (tools/torch_slim.py), one child pytest per version
(tests/_torch_versions.py), and a table of version x feature.

    python tools/torch_matrix.py                      # every minor release, writes the table
    python tools/torch_matrix.py 2.5.1 2.15.0 --out /tmp/t.md

Writes benchmarks/results/torch_versions.md: for each version and feature,
passed, FAILED (the test and its first line) or n/a (why torch or the fake
stack cannot run it), then every failure and skip with its reason. A version
that could not be installed or run gets its reason in one line. Exit status
1 when any test failed (a known failure too: the table is the record).
Run it from a source checkout, with the Python that has gpumempool (cp311,
as the slim installs are made for this Python's version).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import torch_slim  # noqa: E402
from _torch_versions import KNOWN_FAILURES, LIMITATIONS, Outcome, VersionRun, minor, run_version  # noqa: E402

#: The newest patch release of each minor version from 2.5 on PyPI's index.
VERSIONS = ["2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.0", "2.15.0"]

#: Feature -> the tests of tests/test_torch_gpu.py that check it (a name
#: ending in "[" stands for all its parameters).
FEATURES: list[tuple[str, tuple[str, ...]]] = [
    ("capabilities", ("test_capabilities_of_this_torch",)),
    ("gmp.mempool routing", ("test_tensors_come_from_the_pool[", "test_one_torch_pool_per_pool_and_device_reused",
                             "test_nesting_routes_to_the_innermost_pool", "test_stream_is_entered_with_the_pool",
                             "test_backward_inside_all_threads_context")),
    ("thread-local routing", ("test_routing_is_per_thread_unless_all_threads", "test_two_threads_inside_at_once")),
    ("release", ("test_release_and_reentry_without_backend_cost",
                 "test_torch_empty_cache_leaves_a_live_torch_pool")),
    ("set_torch_allocator, stats", ("test_full_replacement", "test_full_replacement_after_cuda_init_is_refused")),
    ("OOM as torch.OutOfMemoryError", ("test_full_replacement_oom_error_torch",)),
    ("CUDA graphs (replacement)", ("test_full_replacement_cuda_graph_keeps_its_memory_private[",)),
    ("torch.cuda.MemPool (replacement)", ("test_full_replacement_torch_mempool_is_private",)),
    ("sharing across processes (replacement)", ("test_full_replacement_shares_tensors_across_processes",)),
    ("snapshot in torch's memory_viz", ("test_snapshot_of_a_routed_pool_reads_in_this_torchs_memory_viz",
                                        "test_torch_memory_viz_renders_our_snapshot")),
    ("MemPool options (use_on_oom, no_split)", ("test_mempool_options_reach_torch_where_it_has_them",
                                                "test_mempool_option_this_torch_lacks_is_one_typed_error")),
    ("torch's per-pool snapshots in gmp.snapshot()", ("test_snapshot_holds_torchs_view_of_each_torch_pool",)),
    ("cache scopes", ("test_cache_scope_peak_stays_flat", "test_cache_scope_refuses_to_invalidate_live_tensors")),
    ("NCCL, CuPy", ("test_nccl_", "test_cupy_")),
]


def _matches(name: str, pattern: str) -> bool:
    return name.startswith(pattern) if pattern.endswith(("[", "_")) else name == pattern


def feature_cell(outcomes: list[Outcome]) -> str:
    """passed / FAILED / n/a for one feature's tests on one version."""
    if not outcomes:
        return "not run"
    failed = [o for o in outcomes if o.outcome in ("failed", "error")]
    passed = [o for o in outcomes if o.outcome == "passed"]
    if failed:
        return f"**FAILED** ({len(failed)}/{len(outcomes)})"
    if passed:
        skipped = len(outcomes) - len(passed)
        return "passed" + (f" ({len(passed)}/{len(outcomes)}, rest n/a)" if skipped else "")
    reasons = sorted({_short(o.reason) for o in outcomes})
    return "n/a: " + "; ".join(reasons)


def _short(reason: str) -> str:
    for key, short in (("needs a real GPU", "real GPU only"), ("createOrIncrefPool", "torch refuses it"),
                       ("ensureExistsAndIncrefPool", "torch refuses it"),
                       ("shareIPcHandle", "torch refuses it"), ("routes every thread", "torch < 2.8"),
                       ("NCCL", "no NCCL"), ("release needs torch >= 2.6", "torch 2.5 cannot release a torch pool")):
        if key in reason:
            return short
    return reason[:60]


def table(runs: list[VersionRun]) -> str:
    """The markdown table and the details below it."""
    head = ["torch"] + [f for f, _ in FEATURES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        if r.error and not r.outcomes:
            lines.append(f"| {r.torch_version} | " + " | ".join(["not run"] * len(FEATURES)) + " |")
            continue
        cells = [feature_cell([o for o in r.outcomes if any(_matches(o.name, p) for p in pats)])
                 for _, pats in FEATURES]
        # tests ran, but the child died or erred after them (an abort at exit): no clean pass
        version = f"{r.torch_version} (**the child died or erred after its tests, see below**)" if r.error \
            else r.torch_version
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    out = ["\n".join(lines), "", "## Limitations, by design, with their reason", ""]
    tested = {minor(r.torch_version) for r in runs if not r.error}
    for versions, text in LIMITATIONS:
        if tested & set(versions):
            out.append(f"- torch {', '.join(versions)}: {text}.")
    out += ["", "## Failures and their causes", ""]
    causes: dict[str, list[str]] = {}
    for r in runs:
        for o in r.failed():
            cause = KNOWN_FAILURES.get((minor(r.torch_version), o.name), "not yet known (not in KNOWN_FAILURES of "
                                       "tests/_torch_versions.py): " + o.reason)
            causes.setdefault(cause, []).append(f"{r.torch_version.split('+')[0]} `{o.name}`")
    for cause, where in causes.items():
        out.append(f"- {cause}. Failed: {', '.join(where)}.")
    if not causes:
        out.append("None.")
    out += ["", "## Each version's failures and skips, as the tests said them", ""]
    for r in runs:
        out.append(f"### torch {r.torch_version}\n")
        if r.error and not r.outcomes:
            out.append(f"Not run: {r.error}\n")
            continue
        if r.error:
            out.append(f"**Error**: {r.error}\n")
        counts = {k: sum(1 for o in r.outcomes if o.outcome == k) for k in ("passed", "failed", "error", "skipped")}
        out.append(", ".join(f"{n} {k}" for k, n in counts.items() if n) + ".\n")
        for o in r.outcomes:
            if o.outcome != "passed":
                out.append(f"- {o.outcome}: `{o.name}`: {o.reason.replace('|', '/')}")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", default=VERSIONS, metavar="VERSION")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "torch_versions.md")
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("GMP_TORCH_CACHE") or Path.home() / ".cache/gpumempool/torch-slim"))
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    runs: list[VersionRun] = []
    for v in args.versions:
        try:
            python = str(torch_slim.install(v, args.cache))
        except Exception as e:  # noqa: BLE001 - one line per version that could not be installed
            runs.append(VersionRun("", v, error=f"could not be installed: {type(e).__name__}: {e}"))
            print(f"torch_matrix: torch {v}: {runs[-1].error}", file=sys.stderr)
            continue
        print(f"torch_matrix: torch {v}: running the tests", file=sys.stderr, flush=True)
        r = run_version(python)
        runs.append(r)
        bad = r.failed()
        print(f"torch_matrix: torch {r.torch_version}: " + (r.error or f"{len(bad)} failed of {len(r.outcomes)}"),
              file=sys.stderr, flush=True)
    text = (f"# The real-torch tests, torch version by version\n\n"
            f"Written by `python tools/torch_matrix.py` ({datetime.date.today()}, {platform.machine()}, "
            f"Python {platform.python_version()}): tests/test_torch_gpu.py under each slim install of "
            "PyPI's CUDA build of torch (tools/torch_slim.py), on the fake CUDA stack of gpumempool.oracle "
            "(one fake 80 GiB device, virtual memory: kernels and copies do nothing, so the checks of tensor "
            "values, NCCL and CuPy run on a real GPU only). CI runs the same for 2.5.1, 2.11.0 and 2.15.0 "
            "(tests/test_torch_versions.py, which lists the known failures with their cause).\n\n"
            "Cells: passed (all of the feature's tests that apply passed), **FAILED** (failed/applicable), n/a "
            "(skipped, with why: the feature is missing in that torch, or needs a real GPU).\n\n"
            + table(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 1 if any(r.error or r.failed() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
