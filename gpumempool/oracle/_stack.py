"""The fake CUDA stack an installed CUDA build of torch runs on without a
GPU: the fake driver (libcuda.so.1, ``tests/csrc/fake_cuda.c`` in its
virtual-memory mode), the fake runtime (``csrc/fake_cudart.c`` with
``cudart_props.c`` compiled against the CUDA release torch was built with),
a fake NVML, and, for a slim install of torch (no NVIDIA wheels but the
runtime's headers), stand-ins with the right SONAMEs and symbol versions
for every other NVIDIA library torch's libraries need.

The package's build prebuilds the driver, NVML and both runtimes into
``lib/`` (buildtools/gmp_oracle_stack.py, with the build's compiler): they
are used when they are what torch needs (the runtime's SONAME, its version
nodes and functions), so a user needs no compiler. Otherwise (no prebuilt
stack, a stale one in a source checkout, another version node) the stack is
compiled with ``cc`` as the stand-ins are, into a cache directory keyed by
what it is built from and the torch install, once per torch. A child process loads the libraries it lists, in
order and with ``RTLD_GLOBAL``, before ``import torch``: torch's libraries
find libcudart through their RPATH, which beats ``LD_LIBRARY_PATH``, but a
library already loaded under the SONAME they need is used as it is."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from .._errors import InvalidArgumentError

#: The C sources of the runtime and NVML, shipped in the package.
CSRC = Path(__file__).resolve().parent / "csrc"
#: The fake driver's source in a source checkout (tests/csrc/fake_cuda.c).
_CHECKOUT = Path(__file__).resolve().parents[2]
#: The stack the package's build prebuilt (buildtools/gmp_oracle_stack.py):
#: libcuda.so.1, libnvidia-ml.so.1, libcudart.so.12 and .13, and
#: stack.json (the digests of the sources they were built from).
PREBUILT = Path(__file__).resolve().parent / "lib"

#: Libraries the system provides: never stubbed.
_SYSTEM = re.compile(r"^(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux.*|libgomp|libz|"
                     r"libquadmath|libgfortran|libutil|libpython.*)\.so")
#: Unversioned symbols that an NVIDIA library provides (NCCL, cuSPARSELt,
#: cuFile, NVSHMEM, the driver): what the common stand-in defines.
_NVIDIA_NAME = re.compile(r"^(nccl|cu|nv|CU|NV)[A-Za-z0-9_]*$")


class FakeStackError(InvalidArgumentError):
    """The fake CUDA stack cannot be built for this torch: ``.missing``
    says what is missing (a compiler, the runtime headers, a function)."""

    def __init__(self, message: str, missing: str = "") -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class TorchInstall:
    """Where a torch is installed and which CUDA runtime it needs."""

    python: str
    torch_dir: Path
    version: str
    cudart_soname: str  # libcudart.so.12 or .13; "" for a CPU-only build

    @property
    def cuda_major(self) -> int:
        return int(self.cudart_soname.rsplit(".", 1)[1]) if self.cudart_soname else 0


@dataclass(frozen=True)
class FakeStack:
    """A built stack: the libraries to load, in order, and the environment
    the child needs."""

    directory: Path
    preload: tuple[str, ...]
    torch: TorchInstall


_FIND_TORCH = r"""
import importlib.util, json, sys
spec = importlib.util.find_spec("torch")
if spec is None or not spec.submodule_search_locations:
    print(json.dumps(None))
else:
    d = spec.submodule_search_locations[0]
    v = None
    try:
        ns = {}
        exec(open(d + "/version.py").read(), ns)
        v = ns.get("__version__")
    except OSError:
        pass
    print(json.dumps({"dir": d, "version": v}))
"""


def find_torch(python: str) -> TorchInstall:
    """The torch that ``python`` imports, found without importing it."""
    try:
        out = subprocess.run([python, "-c", _FIND_TORCH], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise FakeStackError(f"cannot run {python} to find torch: {e}", "python") from None
    if not found:
        raise FakeStackError(f"{python} has no torch: pip install torch (a CUDA build)", "torch")
    torch_dir = Path(found["dir"])
    soname = ""
    for lib in (torch_dir / "lib").glob("libc10_cuda.so*"):
        soname = next((n for n in _needed(lib) if n.startswith("libcudart.so.")), "")
    return TorchInstall(python, torch_dir, str(found.get("version") or "?"), soname)


def _elf(path: Path):  # type: ignore[no-untyped-def]
    try:
        from elftools.elf.elffile import ELFFile
    except ImportError:
        raise FakeStackError("the torch oracle reads torch's libraries with pyelftools: pip install pyelftools",
                             "pyelftools") from None
    return ELFFile(open(path, "rb"))


def _needed(path: Path) -> list[str]:
    e = _elf(path)
    try:
        dyn = e.get_section_by_name(".dynamic")
        return [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"] if dyn else []
    finally:
        e.stream.close()


def _imports(path: Path) -> tuple[dict[str, dict[str, set[str]]], set[str], set[str]]:
    """(versioned undefined symbols by the library named in their version
    need and by version name, unversioned undefined symbols, defined
    symbols) of one ELF file."""
    e = _elf(path)
    try:
        dynsym = e.get_section_by_name(".dynsym")
        versym = e.get_section_by_name(".gnu.version")
        verneed = e.get_section_by_name(".gnu.version_r")
        owner: dict[int, tuple[str, str]] = {}
        if verneed is not None:
            for need, auxes in verneed.iter_versions():
                for aux in auxes:
                    owner[aux["vna_other"]] = (need.name, aux.name)
        versioned: dict[str, dict[str, set[str]]] = {}
        plain: set[str] = set()
        defined: set[str] = set()
        if dynsym is None:
            return versioned, plain, defined
        for i, sym in enumerate(dynsym.iter_symbols()):
            if not sym.name:
                continue
            if sym["st_shndx"] != "SHN_UNDEF":
                defined.add(sym.name)
                continue
            if sym["st_info"]["bind"] == "STB_WEAK":
                continue
            ndx = versym.get_symbol(i)["ndx"] if versym is not None else 0
            lib = owner.get(ndx) if isinstance(ndx, int) else None
            if lib:
                versioned.setdefault(lib[0], {}).setdefault(lib[1], set()).add(sym.name)
            else:
                plain.add(sym.name)
        return versioned, plain, defined
    finally:
        e.stream.close()


def _torch_libraries(torch_dir: Path) -> list[Path]:
    return sorted(p for p in [*(torch_dir / "lib").glob("*.so*"), *torch_dir.glob("_C*.so")] if p.is_file())


def _rpath_dirs(lib: Path) -> list[Path]:
    e = _elf(lib)
    try:
        dyn = e.get_section_by_name(".dynamic")
        out = []
        for t in dyn.iter_tags() if dyn else []:
            if t.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                raw = t.rpath if t.entry.d_tag == "DT_RPATH" else t.runpath
                out += [Path(p.replace("$ORIGIN", str(lib.parent))) for p in raw.split(":") if p]
        return out
    finally:
        e.stream.close()


def _dynamic_strings(path: Path, tag: str) -> list[str]:
    e = _elf(path)
    try:
        dyn = e.get_section_by_name(".dynamic")
        attr = {"DT_SONAME": "soname", "DT_NEEDED": "needed"}[tag]
        return [getattr(t, attr) for t in dyn.iter_tags() if t.entry.d_tag == tag] if dyn else []
    finally:
        e.stream.close()


def version_definitions(path: Path) -> set[str]:
    """The version nodes an ELF library defines (its own name, the base
    entry, left out)."""
    e = _elf(path)
    try:
        verdef = e.get_section_by_name(".gnu.version_d")
        if verdef is None:
            return set()
        return {next(iter(auxes)).name for d, auxes in verdef.iter_versions() if not d["vd_flags"] & 1}
    finally:
        e.stream.close()


def _machine(path: Path) -> str:
    e = _elf(path)
    try:
        return str(e["e_machine"])
    finally:
        e.stream.close()


def _source_digests() -> dict[str, str]:
    """The digests the build records in lib/stack.json (the same sums as
    buildtools/gmp_oracle_stack.py's), of the sources present here: the
    runtime's and NVML's always (they ship in the package), the driver's in
    a source checkout only."""
    out = {"csrc": _digest(list(CSRC.rglob("*.[ch]")), CSRC)}
    driver = _CHECKOUT / "tests" / "csrc" / "fake_cuda.c"
    types = _CHECKOUT / "gocore" / "cuda" / "driver" / "cuda_types.h"
    if driver.is_file() and types.is_file():
        out["driver"] = _digest([driver, types], _CHECKOUT)
    return out


def _digest(files: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(base).parts):
        h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def prebuilt_problem(torch: TorchInstall, cudart_imports: dict[str, set[str]],
                     directory: Optional[Path] = None) -> str:
    """Why the prebuilt stack in ``directory`` (default: the package's)
    cannot serve ``torch``, whose libraries import ``cudart_imports``
    (version node -> functions) from its runtime; "" when it can."""
    d = directory or PREBUILT
    if os.environ.get("GMP_ORACLE_PREBUILT", "1") == "0":
        return "GMP_ORACLE_PREBUILT=0"
    names = ["libcuda.so.1", "libnvidia-ml.so.1", torch.cudart_soname]
    absent = [n for n in names if not (d / n).is_file()]
    if absent:
        return f"{d} has no {', '.join(absent)}"
    try:
        built = json.loads((d / "stack.json").read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{d / 'stack.json'} is missing or unreadable"
    # In a source checkout (an editable install) the sources may have
    # changed since the build: a stale library would judge with old code.
    stale = [k for k, v in _source_digests().items() if built.get(k) != v]
    if stale:
        return f"it was built from other sources ({', '.join(stale)}) than these"
    cudart = d / torch.cudart_soname
    ref = next(iter((torch.torch_dir / "lib").glob("libc10_cuda.so*")), None)
    if ref is not None and _machine(cudart) != _machine(ref):
        return f"it is built for {_machine(cudart)}, torch for {_machine(ref)}"
    if _dynamic_strings(cudart, "DT_SONAME") != [torch.cudart_soname]:
        return f"{cudart.name}'s SONAME is not {torch.cudart_soname}"
    nodes = set(cudart_imports) - version_definitions(cudart)
    if nodes:
        return f"torch {torch.version} needs the version node(s) {', '.join(sorted(nodes))} of {cudart.name}"
    functions = set().union(set(), *cudart_imports.values()) - _imports(cudart)[2]
    if functions:
        return f"{cudart.name} lacks {', '.join(sorted(functions)[:4])}"
    return ""


def runtime_headers(torch: TorchInstall) -> Path:
    """The include directory of the CUDA runtime wheel of torch's CUDA
    release (``nvidia-cuda-runtime-cu12`` or ``nvidia-cuda-runtime``)."""
    site = torch.torch_dir.parent
    major = torch.cuda_major
    for cand in [site / "nvidia" / f"cu{major}" / "include", site / "nvidia" / "cuda_runtime" / "include"]:
        api = cand / "cuda_runtime_api.h"
        if api.is_file():
            m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", api.read_text(errors="replace"))
            if m and int(m.group(1)) // 1000 == major:
                return cand
    pkg = "nvidia-cuda-runtime-cu12" if major == 12 else f"nvidia-cuda-runtime=={major}.*"
    raise FakeStackError(f"torch {torch.version} needs {torch.cudart_soname}, and the fake one is compiled against "
                         f"that release's headers: pip install --no-deps '{pkg}'", pkg)


def _cc(what: str = "the fake CUDA stack is built") -> list[str]:
    """A C compiler: $CC, cc, gcc or clang on PATH, else the ziglang
    package's ``zig cc`` (pip install ziglang: a compiler without root)."""
    cc = os.environ.get("CC", "").split()
    if cc and shutil.which(cc[0]):
        return cc
    found = next((shutil.which(n) for n in ("cc", "gcc", "clang") if shutil.which(n)), None)
    if found:
        return [found]
    zig = _zig_cc()
    if zig:
        return zig
    raise FakeStackError(f"{what} with a C compiler, and there is none: install one (cc, gcc, clang) or "
                         "pip install ziglang", "cc")


def _zig_cc() -> Optional[list[str]]:
    """``zig cc`` of the ziglang package, when this Python has it."""
    return [sys.executable, "-m", "ziglang", "cc"] if importlib.util.find_spec("ziglang") is not None else None


def _compile(cc: list[str], out: Path, sources: Iterable[Path], *flags: str) -> None:
    cmd = [*cc, "-O1", "-shared", "-fPIC", "-pthread", "-o", str(out), *map(str, sources), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FakeStackError(f"building {out.name} failed: {r.stderr.strip().splitlines()[-1:]}", "compile")


def _driver_source() -> Path:
    src = _CHECKOUT / "tests" / "csrc" / "fake_cuda.c"
    if not src.is_file():
        raise FakeStackError("the fake CUDA driver's source (tests/csrc/fake_cuda.c) is in gpumempool's source "
                             "checkout: run the oracle from one", "fake_cuda.c")
    return src


def _stub_source(names: Iterable[str]) -> str:
    lines = ['#include <stdio.h>',
             'static void said(const char *n) { fprintf(stderr, "gpumempool fake CUDA stack: %s is a stand-in '
             '(no compute here)\\n", n); }',
             'static const char text[] = "not available (gpumempool fake CUDA stack)";']
    for n in sorted(names):
        if re.search(r"(String|Name)$", n):
            lines.append(f'const char *{n}(void) {{ return text; }}')
        else:
            lines.append(f'int {n}(void) {{ static int s; if (!s) {{ s = 1; said("{n}"); }} return 1; }}')
    return "\n".join(lines) + "\n"


def cudart_exports(lib: Path) -> set[str]:
    """The functions a built fake runtime exports (torch must import
    nothing else from it)."""
    return _imports(lib)[2]


def build(torch: TorchInstall, cache: Optional[Path] = None) -> FakeStack:
    """Finds in ``cache``, or makes, the fake stack for ``torch``: the
    prebuilt libraries when they serve it (nothing compiled), else compiled
    here; plus, for a slim install, stand-ins for the NVIDIA libraries it
    lacks (compiled here: they depend on the torch install)."""
    if not torch.cudart_soname:
        raise FakeStackError(f"torch {torch.version} at {torch.torch_dir} is a CPU-only build: the oracle needs a CUDA "
                             "build (pip install torch from PyPI on Linux is one)", "cuda build of torch")
    prebuilt = [PREBUILT / n for n in ("libcuda.so.1", "libnvidia-ml.so.1", torch.cudart_soname)]
    # The cheap part of prebuilt_problem() (the rest needs torch's imports).
    unusable = ("GMP_ORACLE_PREBUILT=0" if os.environ.get("GMP_ORACLE_PREBUILT", "1") == "0" else
                "" if all(p.is_file() for p in prebuilt) else f"the package has no {prebuilt[-1].name} in {PREBUILT}")
    use_prebuilt = not unusable
    libs = _torch_libraries(torch.torch_dir)
    h = hashlib.sha256()
    # The key: what the stack is made of. The prebuilt libraries are
    # themselves (a rebuilt package is another key); compiled ones are their
    # sources and headers (the same ones if the prebuilt stack is refused).
    for src in [*(prebuilt if use_prebuilt else []), *sorted(CSRC.rglob("*.[ch]")), Path(__file__)]:
        h.update(src.read_bytes())
    driver_src = _CHECKOUT / "tests" / "csrc" / "fake_cuda.c"
    if driver_src.is_file():
        h.update(driver_src.read_bytes())
    h.update(str(torch.torch_dir).encode())
    h.update(torch.version.encode())
    root = Path(cache or os.environ.get("GMP_ORACLE_CACHE") or Path.home() / ".cache" / "gpumempool" / "oracle")
    directory = root / f"torch-{torch.version}-{h.hexdigest()[:16]}"
    found = _built(directory, torch)
    if found is not None:
        return found

    # What torch imports, and from which library.
    versioned: dict[str, dict[str, set[str]]] = {}
    plain: set[str] = set()
    defined: set[str] = set()
    needed: set[str] = set()
    rpaths: set[Path] = set()
    for lib in libs:
        v, p, d = _imports(lib)
        for k, by_version in v.items():
            for ver, names in by_version.items():
                versioned.setdefault(k, {}).setdefault(ver, set()).update(names)
        plain |= p
        defined |= d
        needed.update(_needed(lib))
        rpaths.update(_rpath_dirs(lib))
    own = {p.name for p in libs}
    cudart = versioned.get(torch.cudart_soname, {})
    refused = prebuilt_problem(torch, cudart) if use_prebuilt else unusable
    fake = {"libcuda.so.1", "libnvidia-ml.so.1", torch.cudart_soname}
    absent = sorted(n for n in needed - own - fake if not _SYSTEM.match(n)
                    and not any((d / n).exists() for d in rpaths))
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=_mkdir(root)))
    try:
        if not refused:
            order = list(prebuilt)
        else:
            headers = runtime_headers(torch)
            driver = _driver_source()
            cc = _cc(f"the fake CUDA stack is not prebuilt for torch {torch.version} ({refused}): it is built")
            _compile(cc, tmp / "libcuda.so.1", [driver], "-Wl,-soname,libcuda.so.1", "-ldl")
            _compile(cc, tmp / "libnvidia-ml.so.1", [CSRC / "fake_nvml.c"], "-Wl,-soname,libnvidia-ml.so.1")
            script = tmp / "cudart.map"
            script.write_text("".join(f"{v} {{ global: cuda*; __cuda*; local: *; }};\n"
                                      for v in sorted(cudart or {torch.cudart_soname: set()})))
            major = torch.cuda_major
            _compile(cc, tmp / torch.cudart_soname,
                     [CSRC / "fake_cudart.c", CSRC / "cudart_props.c", tmp / "libcuda.so.1"],
                     f"-I{CSRC}", f"-I{headers}", f"-DGMP_CUDART_VERSION={major * 1000}",
                     f"-Wl,-soname,{torch.cudart_soname}", f"-Wl,--version-script={script}", "-fvisibility=hidden",
                     "-Wl,--disable-new-dtags,-rpath,$ORIGIN", "-ldl")
            order = [tmp / "libcuda.so.1", tmp / "libnvidia-ml.so.1", tmp / torch.cudart_soname]
        # Torch must find every runtime function it imports, or it would fail
        # to load with a message naming one of them.
        wanted = set().union(*cudart.values()) if cudart else set()
        missing = sorted(wanted - cudart_exports(order[2]))
        if missing:
            raise FakeStackError(f"torch {torch.version} imports {len(missing)} CUDA runtime function(s) the fake "
                                 f"runtime lacks: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}",
                                 ",".join(missing))
        # Stand-ins for the NVIDIA libraries a slim install lacks.
        if absent:
            cc = _cc(f"torch {torch.version} lacks {len(absent)} NVIDIA libraries ({', '.join(absent[:3])}"
                     f"{', ...' if len(absent) > 3 else ''}: a slim install), and their stand-ins are built")
            common_names = {n for n in plain - defined if _NVIDIA_NAME.match(n)}
            (tmp / "common.c").write_text(_stub_source(common_names))
            _compile(cc, tmp / "libgmp_nvidia_common.so", [tmp / "common.c"], "-Wl,-soname,libgmp_nvidia_common.so")
            order.append(tmp / "libgmp_nvidia_common.so")
            for name in absent:
                by_version = versioned.get(name, {})
                src = tmp / f"{name}.c"
                src.write_text(_stub_source(set().union(*by_version.values()) if by_version else set()))
                flags = [f"-Wl,-soname,{name}", "-Wl,--disable-new-dtags,-rpath,$ORIGIN"]
                if by_version:
                    # Each symbol in the version node torch asks it under.
                    vmap = tmp / f"{name}.map"
                    vmap.write_text("".join(f"{ver} {{ global: {'; '.join(sorted(names))}; }};\n"
                                            for ver, names in sorted(by_version.items())))
                    flags.append(f"-Wl,--version-script={vmap}")
                _compile(cc, tmp / name, [src, tmp / "libgmp_nvidia_common.so"], *flags)
                order.append(tmp / name)
        # Prebuilt libraries load from the package; compiled ones from here.
        final = tuple(str(directory / p.name) if p.parent == tmp else str(p) for p in order)
        # The manifest goes in before the rename, so that a stack directory
        # is complete the moment it appears.
        (tmp / "stack.json").write_text(json.dumps({"preload": final, "torch": torch.version,
                                                    "torch_dir": str(torch.torch_dir), "prebuilt": not refused,
                                                    "why_compiled": refused}))
        return _install(tmp, directory, torch, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _built(directory: Path, torch: TorchInstall) -> Optional[FakeStack]:
    """The complete stack in ``directory``, or None."""
    try:
        preload = tuple(json.loads((directory / "stack.json").read_text())["preload"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return FakeStack(directory, preload, torch) if all(Path(p).is_file() for p in preload) else None


def _install(tmp: Path, directory: Path, torch: TorchInstall, final: tuple[str, ...]) -> FakeStack:
    """Moves the stack built in ``tmp`` to ``directory``. Another process may
    have built the same stack meanwhile: a complete one is kept (its child
    may be loading it) and this build dropped; an incomplete one (a build
    that died) is moved aside before it is removed."""
    for _ in range(3):
        try:
            tmp.rename(directory)
            return FakeStack(directory, final, torch)
        except OSError:
            if not directory.exists():
                raise
        found = _built(directory, torch)
        if found is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return found
        stale = Path(tempfile.mkdtemp(prefix="stale-", dir=directory.parent))
        try:
            directory.rename(stale / directory.name)
        except OSError:
            pass  # another process moved it, or finished meanwhile: look again
        shutil.rmtree(stale, ignore_errors=True)
    raise FakeStackError(f"cannot install the fake CUDA stack in {directory}: other builds keep replacing it",
                         "cache")


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
