"""Build script for gpumempool.

The engine is written in Go. gopy (pinned in go.mod, see tools.go) wraps the Go
package ./bindings into one CPython extension module; this file teaches
setuptools to run it:

    gopy build -vm=<this python> -name=gmpcore -dynamic-link=true ./bindings

gopy writes into bindings/_gopy_out/<SOABI>/; we then copy the extension
(_gmpcore<EXT_SUFFIX>) and the Python wrappers gopy generates (__init__.py,
bindings.py, go.py, which import each other relatively) into the sub-package
gpumempool/_core/. gpumempool/_native.py is what imports it.

Project metadata (name, version, dependencies, extras, scripts) lives in
pyproject.toml; only the build logic is here.
"""

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "buildtools"))
import gmp_toolchain  # noqa: E402  (Go and the C/C++ compilers: this machine's or PyPI's)
import gmp_oracle_stack  # noqa: E402  (the oracle's fake CUDA stack, prebuilt into the package)

# Cross-compiling (GMP_ZIG_TARGET=aarch64-... on x86-64): the wheel's
# platform tag and the extension's file names are the target's.
HOST_ARCH = platform.machine().lower()
TARGET_ARCH = gmp_toolchain.target_arch() if sys.platform.startswith("linux") else HOST_ARCH
CROSS = TARGET_ARCH != gmp_toolchain.ARCHES.get(HOST_ARCH, ("", HOST_ARCH))[1]
if CROSS:
    os.environ["_PYTHON_HOST_PLATFORM"] = f"linux-{TARGET_ARCH}"

# The extension module as setuptools sees it. It has no C sources: it is a
# placeholder that makes wheels platform-specific and makes build_ext run.
EXT_NAME = "gpumempool._core._gmpcore"
GOPY_NAME = "gmpcore"  # gopy -name; must not start with "_" (Go skips _*.go)
GO_PACKAGE = "./bindings"
# Python files gopy generates next to the extension (build.py is not needed).
GOPY_PY_FILES = ("__init__.py", "bindings.py", "go.py")
# Build-time tools, pinned by go.mod through tools.go.
GO_TOOLS = (
    ("gopy", "github.com/go-python/gopy"),
    ("goimports", "golang.org/x/tools/cmd/goimports"),
)
GO_MOD_FILES = ("go.mod", "go.sum")
EXE = ".exe" if os.name == "nt" else ""


def say(msg):
    print(f"gpumempool: {msg}", flush=True)


def run(cmd, env):
    """Run cmd from the module root, returning the CompletedProcess (output merged)."""
    say("$ " + " ".join(cmd))
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,  # gopy hands its stdin to the python it runs
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_logged(cmd, env, what):
    """Run cmd from the module root; on failure stop the build, showing its output."""
    proc = run(cmd, env)
    if proc.returncode != 0:
        print(proc.stdout, flush=True)
        raise CompileError(f"{what} failed (exit status {proc.returncode}); its output is above.")
    return proc.stdout


def drop_run_paths(path):
    """Remove DT_RPATH/DT_RUNPATH from a 64-bit little-endian ELF shared
    library (x86-64, aarch64) in place, as `patchelf --remove-rpath` does:
    the dynamic entries after them move up, DT_NULL fills the end. Returns
    whether there was one."""
    import struct

    with open(path, "rb") as f:
        data = bytearray(f.read())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type != 2:  # PT_DYNAMIC
            continue
        entries = [bytes(data[p_offset + j:p_offset + j + 16]) for j in range(0, p_filesz - 15, 16)]
        kept = [e for e in entries if struct.unpack_from("<q", e)[0] not in (15, 29)]  # DT_RPATH, DT_RUNPATH
        if len(kept) == len(entries):
            return False
        kept += [bytes(16)] * (len(entries) - len(kept))
        data[p_offset:p_offset + 16 * len(entries)] = b"".join(kept)
        with open(path, "wb") as f:
            f.write(data)
        return True
    return False


class GopyBuildExt(build_ext):
    """build_ext that builds the Go extension with gopy instead of a C compiler."""

    def run(self):
        # The compilers are chosen before build_ext makes its own (for
        # _fastcall.c): setuptools reads CC/CXX/LDSHARED when it does.
        try:
            self.toolchain = gmp_toolchain.toolchain(os.path.join(ROOT, "build"))
        except gmp_toolchain.ToolchainError as exc:
            raise CompileError(str(exc)) from None
        say("toolchain: " + self.toolchain.describe())
        if self.toolchain.zig:
            os.environ["CC"] = self.toolchain.env["CC"]
            os.environ["CXX"] = self.toolchain.env["CXX"]
            os.environ.pop("LDSHARED", None)  # derived from CC
        # A C extension built earlier by other compilers (or for another
        # CPU) would look up to date: build it again, it takes a second.
        self.force = True
        super().run()
        self._build_oracle_stack()

    def _oracle_lib_dir(self):
        root = ROOT if self.inplace else self.build_lib
        return os.path.join(root, gmp_oracle_stack.PACKAGE_DIR)

    def _build_oracle_stack(self):
        """The oracle's fake driver, NVML and CUDA 12 and 13 runtimes, built
        with this build's C compiler into gpumempool/oracle/lib/, so that
        users without a compiler can run it. Optional: without it (no
        runtime headers offline, GMP_ORACLE_PREBUILT=0) the oracle compiles
        the stack with cc where it runs, as it did before."""
        dest = self._oracle_lib_dir()
        if os.environ.get("GMP_ORACLE_PREBUILT", "1") == "0":
            shutil.rmtree(dest, ignore_errors=True)
            say("GMP_ORACLE_PREBUILT=0: the oracle's fake CUDA stack is not prebuilt")
            return
        t0 = time.monotonic()
        try:
            gmp_oracle_stack.build(self.toolchain.cc, dest)
        except gmp_oracle_stack.StackError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            say(f"warning: the oracle's fake CUDA stack is not prebuilt ({exc}); gpumempool.oracle will "
                "compile it with a C compiler where it runs")
            return
        say(f"prebuilt the oracle's fake CUDA stack ({', '.join(gmp_oracle_stack.LIBRARIES)}) into {dest} "
            f"in {time.monotonic() - t0:.1f}s")

    def get_ext_filename(self, ext_name):
        name = super().get_ext_filename(ext_name)
        if CROSS:  # sysconfig's suffix is this Python's: .cpython-311-x86_64-linux-gnu.so
            name = name.replace(f"-{HOST_ARCH}-linux-gnu", f"-{TARGET_ARCH}-linux-gnu")
        return name

    def build_extension(self, ext):
        if ext.name != EXT_NAME:
            super().build_extension(ext)
            # Python's own link flags may carry -Wl,-rpath,<its lib dir>
            # (pyenv, --enable-shared builds): an extension needs no run
            # path, and a wheel must not carry the build machine's.
            drop_run_paths(self.get_ext_fullpath(ext.name))
            return

        if importlib.util.find_spec("pybindgen") is None:
            raise CompileError(
                f"gopy needs the pybindgen package in the building Python "
                f"({sys.executable}); `pip install .` installs it automatically, "
                "otherwise run `pip install pybindgen`."
            )

        go, env = self.toolchain.go, dict(self.toolchain.env)
        # VCS stamping is useless for the extension, and fails in checkouts
        # git does not trust or that have no commits.
        if "-buildvcs" not in env.get("GOFLAGS", ""):
            env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -buildvcs=false").strip()

        say(run_logged([go, "version"], env, "go version").strip())
        gopy = self._ensure_tools(go, env)

        tag = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
        # One directory per build: two builds of the same checkout at once
        # (pip install while a wheel builds) must not clobber each other.
        out_dir = os.path.join(ROOT, "bindings", "_gopy_out", f"{tag}-{os.getpid()}")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        say(f"building the Go extension with gopy into {out_dir}")
        t0 = time.monotonic()
        # gopy builds with `go build -mod=mod`, which rewrites go.mod/go.sum
        # when they are not tidy; a build must not edit the checkout.
        # (GOFLAGS=-modfile=<copy> would avoid that, but gopy's package
        # loader also runs go with GO111MODULE=off, where -modfile is an error.)
        saved = self._snapshot(GO_MOD_FILES)
        try:
            output = run_logged(
                [
                    gopy,
                    "build",
                    f"-output={out_dir}",
                    f"-vm={sys.executable}",
                    f"-name={GOPY_NAME}",
                    "-dynamic-link=true",
                    GO_PACKAGE,
                ],
                env,
                "gopy build",
            )
        finally:
            self._restore(saved)
        say(f"gopy build done in {time.monotonic() - t0:.1f}s")

        ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built_so = os.path.join(out_dir, "_" + GOPY_NAME + ext_suffix)
        wanted = [built_so] + [os.path.join(out_dir, f) for f in GOPY_PY_FILES]
        missing = [p for p in wanted if not os.path.isfile(p)]
        if missing:
            print(output, flush=True)
            raise CompileError(
                "gopy build reported success but did not produce "
                + ", ".join(missing)
                + "; its output is above."
            )

        dest_so = self.get_ext_fullpath(ext.name)
        dest_dir = os.path.dirname(dest_so)
        os.makedirs(dest_dir, exist_ok=True)
        shutil.copyfile(built_so, dest_so)
        # gopy links with Python's LDSHARED flags too (as build_extension
        # says for the C extension).
        if drop_run_paths(dest_so):
            say(f"removed the build Python's run path from {os.path.basename(dest_so)}")
        for name in GOPY_PY_FILES:
            shutil.copyfile(os.path.join(out_dir, name), os.path.join(dest_dir, name))
        say(f"installed the extension into {dest_dir}")
        shutil.rmtree(out_dir, ignore_errors=True)  # kept only when the build fails

    def _ensure_tools(self, go, env):
        """Return the gopy to run; build missing tools into build/tools.

        Tools already on PATH are used as they are. gopy runs goimports from
        PATH, so build/tools is put first on env["PATH"].
        """
        tools_dir = os.path.join(ROOT, "build", "tools")
        env["PATH"] = tools_dir + os.pathsep + env.get("PATH", "")
        found = {}
        for name, pkg in GO_TOOLS:
            path = shutil.which(name, path=os.environ.get("PATH"))
            if path:
                say(f"using {name} from PATH: {path}")
            else:
                path = os.path.join(tools_dir, name + EXE)
                say(f"building {name} ({pkg}, version pinned by go.mod) into {tools_dir}")
                t0 = time.monotonic()
                self._build_tool(go, env, pkg, path)
                say(f"built {name} in {time.monotonic() - t0:.1f}s")
            found[name] = path
        return found["gopy"]

    def _build_tool(self, go, env, pkg, path):
        """Build a tool at the version go.mod pins, leaving go.mod/go.sum alone.

        go.sum need not list every dependency of the tool's main package
        (`go mod tidy` keeps only what tools.go imports), so build with
        -mod=mod against a copy of go.mod/go.sum in build/gomod/: Go may add
        checksums to the copy; the module versions stay the pinned ones.
        """
        gomod_dir = os.path.join(ROOT, "build", "gomod")
        os.makedirs(gomod_dir, exist_ok=True)
        for name, data in self._snapshot(GO_MOD_FILES).items():
            if data is not None:
                with open(os.path.join(gomod_dir, name), "wb") as f:
                    f.write(data)
        modfile = os.path.join(gomod_dir, "go.mod")
        # Tools run here: built for this machine (the extension may be
        # cross-compiled) and in pure Go.
        tool_env = {k: v for k, v in env.items() if k not in ("GOOS", "GOARCH")}
        tool_env["CGO_ENABLED"] = "0"
        run_logged(
            [go, "build", f"-modfile={modfile}", "-mod=mod", "-o", path, pkg],
            tool_env,
            f"building {os.path.basename(path)}",
        )

    @staticmethod
    def _snapshot(names):
        saved = {}
        for name in names:
            try:
                with open(os.path.join(ROOT, name), "rb") as f:
                    saved[name] = f.read()
            except FileNotFoundError:
                saved[name] = None
        return saved

    def _restore(self, saved):
        for name, data in self._snapshot(saved).items():
            if data == saved[name]:
                continue
            path = os.path.join(ROOT, name)
            if saved[name] is None:
                os.remove(path)
            else:
                with open(path, "wb") as f:
                    f.write(saved[name])
            say(
                f"note: gopy's `go build -mod=mod` changed {name}; restored it. "
                "It is probably not tidy: `go mod tidy` makes such changes for good."
            )

    def _gopy_py_outputs(self, so_path):
        d = os.path.dirname(so_path)
        return [os.path.join(d, name) for name in GOPY_PY_FILES]

    def copy_extensions_to_source(self):
        # setuptools copies the .so for --inplace / editable installs; the
        # generated wrappers must go along with it, into gpumempool/_core/
        # (which is generated, so it may not exist yet).
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_so, _ = self._get_inplace_equivalent(build_py, ext)
            os.makedirs(os.path.dirname(inplace_so) or ".", exist_ok=True)
        super().copy_extensions_to_source()
        for ext in self.extensions:
            if ext.name == EXT_NAME:
                inplace_so, regular_so = self._get_inplace_equivalent(build_py, ext)
                for src, dst in zip(
                    self._gopy_py_outputs(regular_so), self._gopy_py_outputs(inplace_so)
                ):
                    self.copy_file(src, dst, level=self.verbose)

    def get_outputs(self):
        outputs = list(super().get_outputs())
        lib_dir = self._oracle_lib_dir()
        outputs += [os.path.join(lib_dir, n) for n in (*gmp_oracle_stack.LIBRARIES, gmp_oracle_stack.MANIFEST)
                    if os.path.isfile(os.path.join(lib_dir, n))]
        if not self.inplace:
            for ext in self.extensions:
                if ext.name == EXT_NAME:
                    outputs += self._gopy_py_outputs(self.get_ext_fullpath(ext.name))
        return outputs

    def get_output_mapping(self):
        mapping = dict(super().get_output_mapping())
        for regular, inplace in list(mapping.items()):
            if os.path.basename(regular).startswith("_" + GOPY_NAME + "."):
                mapping.update(
                    zip(self._gopy_py_outputs(regular), self._gopy_py_outputs(inplace))
                )
        return mapping


# gpumempool/_core/ is generated (and git-ignored); build_ext fills it in.
PACKAGES = ["gpumempool"] + [
    p
    for p in find_packages(where=ROOT, include=["gpumempool.*"])
    if p != "gpumempool._core" and not p.startswith("gpumempool._core.")
]

setup(
    packages=PACKAGES,
    package_data={"gpumempool": ["py.typed", "*.pyi", "csrc/*.c", "csrc/*.cpp"],
                  # the oracle's fake CUDA runtime and NVML, built with cc where it runs
                  "gpumempool.oracle": ["csrc/*.c", "csrc/crt/*.h", "proven.json"]},
    ext_modules=[
        Extension(EXT_NAME, sources=[]),
        # MemPool.alloc/free's fast path (a plain C extension; see its header).
        Extension("gpumempool._fastcall", sources=["gpumempool/csrc/_fastcall.c"], libraries=["dl"]),
    ],
    cmdclass={"build_ext": GopyBuildExt},
    zip_safe=False,
)
