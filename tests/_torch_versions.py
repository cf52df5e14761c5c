"""The real-torch tests (tests/test_torch_gpu.py) under another Python's
torch, on the oracle's fake CUDA stack (gpumempool.oracle._stack): a child
pytest run by that Python, for tests/test_torch_versions.py (CI, three
versions) and tools/torch_matrix.py (every minor release).

The child gets a site directory of its own on PYTHONPATH: gpumempool (a
link to the package this process imports, whose extension is cp311 like the
slim installs of tools/torch_slim.py) and a sitecustomize that loads the
stack's libraries with RTLD_GLOBAL before anything imports torch, in that
child and in every Python it starts (the tests' fresh-process scripts,
torch.multiprocessing's spawned children). GMP_FAKE_CUDA_STACK=1 tells the
tests they run there: kernels and copies do nothing, so the checks of
tensor values are skipped (their tests are marked ``real_gpu``, or check
values only on a real GPU)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gpumempool.oracle import FakeStack

ROOT = Path(__file__).resolve().parent.parent
#: The tests run in the child (files or node ids), relative to the repository.
TEST_FILES = ("tests/test_torch_gpu.py",
              # torch's own tools read our snapshots (a test that needs torch, no GPU)
              "tests/test_snapshot.py::test_torch_memory_viz_renders_our_snapshot")
GiB = 1 << 30

#: Tests that fail on a torch minor version, with the cause (found by
#: tools/torch_matrix.py). tests/test_torch_versions.py checks that each
#: still fails there: one that passes is a fix, whose line goes. (Empty: the
#: failures the matrix found, torch 2.5's release and the abort of 2.6/2.7's
#: backward, are fixed or made the LIMITATIONS below.)
KNOWN_FAILURES: dict[tuple[str, str], str] = {}

_NO_RELEASE = "release needs torch >= 2.6"
#: What gpumempool cannot do on some torch versions, by design, with the
#: reason: (the minor versions, the limitation). The matrix's table lists them.
LIMITATIONS: list[tuple[tuple[str, ...], str]] = [
    (("2.5",), "gmp.torch.release (and invalidating a cache scope with torch=True) raises TorchVersionError: "
               "torch 2.5's use_mem_pool never drops the torch pool's use count and its MemPool has no destructor, "
               "so torch never frees the pool, and forcing it (_cuda_releasePool, then empty_cache) frees our "
               "segments with cudaFree, not the pool's free function. Torch keeps them cached for the next "
               "gmp.mempool(pool); closing the pool returns them to the backend"),
    (("2.5",), "under set_torch_allocator a torch.cuda.MemPool's private pool outlives the MemPool (torch 2.5 "
               "calls no _cuda_releasePool): the caller releases it with torch._C._cuda_releasePool(device, "
               "mp.id), once per use_mem_pool entry"),
    (("2.5", "2.6", "2.7"), "backward inside gmp.mempool: autograd's thread puts its new segments in the torch pool "
                            "with cudaMalloc (the allocator comes from a thread-local MemPoolContext), and torch's "
                            "MemPool destructor would free them through the pool's free function, which throws "
                            "from the destructor and aborts the process; release() keeps such a torch pool for the "
                            "life of the process instead, with a RetainedTorchPoolWarning (2.6, 2.7; on 2.5 "
                            "release refuses anyway)"),
]
#: Tests that must pass (tests/test_torch_versions.py's MUST_PASS) but skip
#: on a version by design: (minor, test) -> what their skip reason says.
EXPECTED_SKIPS: dict[tuple[str, str], str] = {
    ("2.5", "test_release_and_reentry_without_backend_cost"): _NO_RELEASE,
    ("2.5", "test_cache_scope_peak_stays_flat"): _NO_RELEASE,
    # MemPool's use_on_oom came in 2.8, no_split in 2.10
    **{(v, "test_mempool_options_reach_torch_where_it_has_them"): "MemPool has neither use_on_oom"
       for v in ("2.5", "2.6", "2.7")},
}

#: Loads the fake stack before torch in every Python started with this site
#: directory on its path; a library that does not load ends the process
#: with one line (torch would otherwise load without CUDA and every test
#: would fail for a reason far from the cause).
SITECUSTOMIZE = '''\
import ctypes, os, sys
for _path in os.environ.get("GMP_FAKE_CUDA_PRELOAD", "").split(os.pathsep):
    if _path:
        try:
            ctypes.CDLL(_path, mode=ctypes.RTLD_GLOBAL)
        except OSError as _exc:
            sys.stderr.write(f"gpumempool fake CUDA stack: cannot load {_path}: {_exc}\\n")
            raise SystemExit(3)
'''


@dataclass(frozen=True)
class Outcome:
    """One test of the child run: passed, failed, error or skipped, and
    why (the failure's first line, the skip's reason)."""

    name: str
    outcome: str
    reason: str = ""


@dataclass
class VersionRun:
    """The child run under one torch: its tests' outcomes, or ``error``
    when it did not run (no stack for this torch, the child died)."""

    python: str
    torch_version: str = "?"
    outcomes: list[Outcome] = field(default_factory=list)
    error: str = ""
    output: str = ""

    def by_name(self) -> dict[str, Outcome]:
        return {o.name: o for o in self.outcomes}

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.outcome in ("failed", "error")]


def minor(version: str) -> str:
    """"2.5" of "2.5.1+cu124"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def site_dir(work: Path) -> Path:
    """The child's site directory (see the module's docstring)."""
    import gpumempool

    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    link = site / "gpumempool"
    if not link.exists():
        link.symlink_to(Path(gpumempool.__file__).resolve().parent, target_is_directory=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


def child_env(stack: "FakeStack", site: Path, work: Path) -> dict[str, str]:
    """The child's environment: the oracle's (one fake device of 80 GiB in
    virtual mode, no allocator settings from this shell), the stack to
    preload, the site directory, a cache of its own for the OOM shim."""
    from gpumempool.oracle import torch_env

    env = torch_env(stack, "", 80 * GiB, 1)
    env.pop("PYTHONWARNINGS", None)  # the tests check warnings
    env.update(PYTHONPATH=str(site), GMP_FAKE_CUDA_PRELOAD=os.pathsep.join(stack.preload), GMP_FAKE_CUDA_STACK="1",
               GMP_CACHE_DIR=str(work / "cache"))
    return env


def run_version(python: str, work: Optional[Path] = None, tests: tuple[str, ...] = TEST_FILES,
                select: str = "", timeout: float = 1200, rootdir: Path = ROOT) -> VersionRun:
    """Runs ``tests`` (paths under ``rootdir``, relative to it or absolute)
    under ``python``'s torch on the fake stack, in ``work`` (default: a
    temporary directory, removed after)."""
    from gpumempool.oracle import FakeStackError, _stack

    if work is None:
        with tempfile.TemporaryDirectory(prefix="gmp-torch-versions-") as tmp:
            return run_version(python, Path(tmp), tests, select, timeout, rootdir)

    run = VersionRun(python)
    try:
        torch = _stack.find_torch(python)
        run.torch_version = torch.version
        stack = _stack.build(torch)
    except FakeStackError as e:
        run.error = f"no fake CUDA stack: {e}"
        return run
    work.mkdir(parents=True, exist_ok=True)
    site = site_dir(work)
    env = child_env(stack, site, work)
    xml = work / "junit.xml"
    crashed: list[Outcome] = []
    crashed_ids: list[str] = []
    # A test that kills the process (an abort in torch's C++) takes the
    # report with it: that test is recorded as failed with the process's
    # last words, and the run is made again without it. (--capture=sys:
    # what C++ writes goes to the real stderr, not to a buffer lost then.)
    for _ in range(MAX_CRASHES + 1):
        xml.unlink(missing_ok=True)
        cmd = [python, "-m", "pytest", "-v", "-rfEs", "--capture=sys", "-p", "no:cacheprovider", f"--junitxml={xml}",
               f"--rootdir={rootdir}", *(str(rootdir / t) for t in tests), *(["-k", select] if select else []),
               *(a for nodeid in crashed_ids for a in ("--deselect", nodeid))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=rootdir, env=env)
        except subprocess.TimeoutExpired:
            run.error = f"the child pytest ran past {timeout:.0f} s"
            break
        run.output = (proc.stdout + proc.stderr)[-8000:]
        if xml.is_file():
            run.outcomes = read_junit(xml)
            # pytest exits 0 (all passed) or 1 (some failed); anything else
            # is no verdict: 5, nothing collected (no outcome is no pass);
            # a signal after the report (a destructor aborting at exit).
            if proc.returncode not in (0, 1) or not run.outcomes:
                run.error = (f"the child pytest exited {_exit(proc.returncode)} after its report"
                             f" ({len(run.outcomes)} tests): {_last_words(proc.stderr)}")
            break
        started = re.findall(r"^(\S+::\S+) ?(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)?", proc.stdout, re.M)
        if not started or started[-1][1]:
            last = [line for line in run.output.strip().splitlines() if line.strip()][-1:]
            run.error = f"the child pytest exited {proc.returncode} without a report: {last[0] if last else ''}"
            break
        nodeid = started[-1][0]
        crashed_ids.append(nodeid)
        said = f"the process died ({_exit(proc.returncode)}) in this test: {_last_words(proc.stderr)}"
        crashed.append(Outcome(nodeid.split("::")[-1], "failed", said))
    else:
        run.error = f"more than {MAX_CRASHES} tests killed the process"
    run.outcomes = [*crashed, *run.outcomes]
    return run


#: How many tests may kill the child before the run is given up.
MAX_CRASHES = 8


def _exit(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _last_words(stderr: str) -> str:
    """What a dying process said before Python's fatal-error dump: the C++
    exception that ended it (terminate called ..., what(): ...), else its
    last lines."""
    text = stderr.split("Fatal Python error")[0]
    if "terminate called" in text:
        text = text[text.rindex("terminate called"):]
        text = re.split(r"\n(?:Exception raised from|frame #)", text)[0]
        said = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        said = [line.strip() for line in text.splitlines()
                if line.strip() and not line.startswith((" ", "Traceback", "frame #"))][-3:]
    return " / ".join(said)[:400] or "no message"


def read_junit(path: Path) -> list[Outcome]:
    """The outcomes in a pytest --junitxml report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                # A failure's message is cut short; its report's "E" lines are whole.
                said = [line[1:].strip() for line in (el.text or "").splitlines() if line.startswith("E ")]
                reason = _first_line("\n".join(said) if tag != "skipped" and said else el.get("message") or "")
                break
        out.append(Outcome(name, outcome, reason))
    return out


def _first_line(text: str) -> str:
    """A failure's or skip's first line; where that only announces what
    follows (a script's output), the last line of it too: the exception."""
    lines = [line.strip() for line in text.strip().removeprefix("Skipped: ").splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        raised = [line for line in lines[1:] if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", line)]
        first = f"{first} ... {(raised or lines)[-1]}"
    return first[:400]

if __name__ == "__main__":  # python tests/_torch_versions.py PYTHON [-k EXPR]: the outcomes, one a line
    r = run_version(sys.argv[1], select=sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "-k" else "")
    print(f"torch {r.torch_version}: {r.error or ''}")
    for o in r.outcomes:
        print(f"{o.outcome:8} {o.name}  {o.reason}")
    if r.error:
        print(r.output)
