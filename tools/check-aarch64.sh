#!/usr/bin/env bash
# Prove that an aarch64 (arm64) manylinux wheel of gpumempool really runs, on
# an x86_64 Debian machine, under qemu user-mode emulation. One command, from
# any directory:
#
#     bash tools/check-aarch64.sh path/to/gpumempool-*-cp311-cp311-manylinux*_aarch64.whl
#
# Steps (each prints its time; a summary comes at the end):
#   qemu     qemu-aarch64-static from Debian's qemu-user-static (apt-get
#            install when it is missing; that needs root).
#   sysroot  An arm64 root with Debian's python3.11 and everything it needs at
#            run time (libc6, libpython3.11-stdlib, libssl3, libffi8, ...: the
#            dependency closure of python3.11 and libstdc++6, less dpkg, perl
#            and tar), fetched with `apt-get download` and unpacked with
#            `dpkg -x`. apt runs with a private configuration (its own copy of
#            the system's sources files, so the same archives and signing keys;
#            its own lists, cache and an empty dpkg status; APT::Architecture
#            arm64): nothing system-wide changes, no `dpkg --add-architecture`.
#            Reused as it is by later runs (no network needed then).
#   install  The host's pip installs, for manylinux2014_aarch64 / cp311, the
#            wheel (--no-deps) and then tqdm and pytest with their (pure
#            Python) dependencies (pip-downloaded once into the cache) into a
#            fresh target directory, the emulated Python's PYTHONPATH.
#   import   `python -c 'import gpumempool, platform; ...'` prints aarch64 and
#            the library's path.
#   demo     `python -m gpumempool demo --steps 50 --no-progress`.
#   pytest   The tests that drive the engine through Python and need no
#            torch, GPU or C compiler (list: TEST_FILES below, and the reasons
#            there), from a copy of tests/ in a temporary directory with
#            PYTHONSAFEPATH=1 (as .ci/test), so the checkout's unbuilt
#            gpumempool/ is never imported. Tests that build a tests/csrc
#            helper with a C compiler are skipped with that reason.
# "python" above is the sysroot's interpreter run as
#     qemu-aarch64-static -L SYSROOT SYSROOT/usr/bin/python3.11
# through a small wrapper (SYSROOT/usr/bin/python3.11-qemu), so that
# sys.executable is runnable by the host and the tests that start a
# subprocess of sys.executable work without binfmt_misc.
# Exits non-zero when any step fails, any test fails or errors, or no test ran.
#
# Cache: ${GMP_AARCH64_CACHE:-$HOME/.cache/gpumempool-aarch64}, holding
# apt/ (the private apt state), sysroot/ (complete once sysroot/.complete
# exists; about 65 MB) and wheels/ (tqdm, pytest and their dependencies).
# Delete it, or set GMP_AARCH64_REFRESH=1, to fetch the packages again.
#
# Environment:
#   PYTHON                 the host Python whose pip installs (default python3)
#   GMP_AARCH64_CACHE      the cache directory (above)
#   GMP_AARCH64_REFRESH=1  rebuild the sysroot from freshly downloaded packages
#   GMP_AARCH64_TESTS      test files to run instead of TEST_FILES (space-separated, relative to tests/)
#   GMP_AARCH64_CC         an aarch64 C compiler command (e.g. a `zig cc -target
#                          aarch64-linux-gnu` wrapper): the tests that build
#                          tests/csrc C helpers then run instead of skipping
#   GMP_AARCH64_CXX        the aarch64 C++ compiler that builds tests/csrc/torch_caller.cpp,
#                          the stand-in for torch that calls the C entry points with
#                          libstdc++'s std::function and catches their C++ exceptions
#                          (default aarch64-linux-gnu-g++, Debian's g++-aarch64-linux-gnu,
#                          installed with apt-get when missing; "none" skips those tests)
#   GMP_AARCH64_TIMEOUT    seconds the pytest step may take (default 1800)
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GMP_AARCH64_CACHE:-$HOME/.cache/gpumempool-aarch64}
HOST_PY=${PYTHON:-python3}
QEMU=qemu-aarch64-static

# The engine's tests that run here: they drive the Go engine through Python
# and need no torch, GPU or compiler (the few that build tests/csrc C helpers
# skip, or run with GMP_AARCH64_CC):
#   test_pool.py        the MemPool API over the sim backend: alloc/free, stats,
#                       limits, streams, summaries
#   test_bad_input.py   argument checking at the Python/Go boundary
#   test_reliability.py threads on pools, injected faults, exit with live
#                       pools (a subprocess of sys.executable), C-heap leaks
#   test_snapshot.py    snapshots and history in torch's format
#   test_trace_replay.py trace loading (gzip, pickle through the restricted
#                       loader) and replays through the engine (the slowest
#                       file under emulation, about 1.5 of ~3 minutes)
#   test_safepickle.py  the Go pickle scanner (through _fastcall) against the
#                       Python one
#   test_callbacks.py   Python callback pools: the Go engine calling back into
#                       Python from many threads, re-entry, interpreter exit
#   test_cabi.py        the exported C ABI in the library Python loaded (via
#                       ctypes)
#   test_cli.py         python -m gpumempool info/demo (subprocesses)
#   test_readme.py      README's sim examples run as written
#   test_fork.py        a forked child of a process with pools is refused, never
#                       hangs (pthread_atfork and the Go runtime on aarch64)
# Left out: test_ipc_fake.py, test_gpu_backends_fake.py (built fake
# libcuda/libnccl for every test), test_torch_*.py, test_gpu*.py (torch or a
# GPU), test_cuda_headers.py (a C compiler and CUDA headers), test_plot_cli.py
# (matplotlib).
TEST_FILES=(test_pool.py test_bad_input.py test_reliability.py test_snapshot.py test_trace_replay.py
            test_safepickle.py test_callbacks.py test_cabi.py test_cli.py test_readme.py test_fork.py)
if [[ -n "${GMP_AARCH64_TESTS:-}" ]]; then
  read -r -a TEST_FILES <<<"$GMP_AARCH64_TESTS"
fi

say() { echo "check-aarch64: $*" >&2; }
die() { echo "check-aarch64: error: $*" >&2; exit 1; }

T_START=$SECONDS
T_STAGE=$SECONDS
STAGE=""
TIMES=()
stage() {  # stage NAME: close the running stage (recording its time), start NAME
  if [[ -n "$STAGE" ]]; then
    TIMES+=("$(printf '%-8s %4ds' "$STAGE" $((SECONDS - T_STAGE)))")
    say "$STAGE: done in $((SECONDS - T_STAGE))s"
  fi
  STAGE=$1
  T_STAGE=$SECONDS
  [[ -n "$STAGE" ]] && say "== $STAGE" || true
}
summary() {
  local s
  for s in "${TIMES[@]}"; do say "  $s"; done
  say "  total    $((SECONDS - T_START))s"
}

# -- arguments and the wheel --------------------------------------------------
[[ $# -eq 1 && $1 != -* ]] || die "usage: bash tools/check-aarch64.sh path/to/gpumempool-*-cp311-cp311-manylinux*_aarch64.whl"
WHEEL=$1
[[ -f "$WHEEL" ]] || die "wheel not found: $WHEEL"
WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
case $(basename "$WHEEL") in
  gpumempool-*-cp311-cp311-*manylinux*_aarch64*.whl) ;;
  *) die "not a CPython 3.11 manylinux aarch64 wheel of gpumempool (want gpumempool-*-cp311-cp311-manylinux*_aarch64.whl): $(basename "$WHEEL")" ;;
esac
command -v "$HOST_PY" >/dev/null || die "no host Python '$HOST_PY' (set PYTHON)"
"$HOST_PY" -m pip --version >/dev/null 2>&1 || die "the host Python $HOST_PY has no pip (set PYTHON to one that has)"
# Every shared object in the wheel must be an aarch64 ELF (e_machine 183).
"$HOST_PY" - "$WHEEL" <<'EOF' || die "$(basename "$WHEEL") is not an aarch64 build (above)"
import struct, sys, zipfile
try:
    zf = zipfile.ZipFile(sys.argv[1])
except zipfile.BadZipFile as e:
    sys.exit(f"not a wheel (zip): {e}")
sos, bad = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n], []
for n in sos:
    head = zf.open(n).read(20)
    if head[:4] != b"\x7fELF" or head[4] != 2 or struct.unpack("<H", head[18:20])[0] != 183:
        bad.append(n)
if not sos:
    sys.exit("the wheel holds no shared library")
if bad:
    sys.exit("not 64-bit aarch64 ELF: " + ", ".join(bad))
print("check-aarch64: wheel: " + ", ".join(sos) + ": aarch64 ELF", file=sys.stderr)
EOF

# -- qemu ---------------------------------------------------------------------
stage qemu
if ! command -v "$QEMU" >/dev/null; then
  [[ $(id -u) -eq 0 ]] || die "$QEMU is missing; install it: sudo apt-get install qemu-user-static"
  say "installing qemu-user-static with apt-get"
  apt-get update -q >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static >&2 || die "apt-get install qemu-user-static failed"
  command -v "$QEMU" >/dev/null || die "qemu-user-static is installed but $QEMU is not on PATH"
fi
QEMU=$(command -v "$QEMU")
say "$("$QEMU" --version | head -1)"
# torch's C++ ABI on aarch64 (std::function, exceptions): a g++ with
# libstdc++ builds the stand-in caller; the sysroot has the run-time libstdc++.
CXX_AARCH64=${GMP_AARCH64_CXX:-aarch64-linux-gnu-g++}
if [[ "$CXX_AARCH64" != none ]] && ! command -v "${CXX_AARCH64%% *}" >/dev/null; then
  if [[ -z "${GMP_AARCH64_CXX:-}" && $(id -u) -eq 0 ]]; then
    say "installing g++-aarch64-linux-gnu with apt-get (the C++ caller of the torch entry points)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu >&2 \
      || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu >&2; } \
      || die "apt-get install g++-aarch64-linux-gnu failed (GMP_AARCH64_CXX=none skips the C++ caller's tests)"
  else
    die "no aarch64 C++ compiler '$CXX_AARCH64' (install g++-aarch64-linux-gnu, or GMP_AARCH64_CXX=none)"
  fi
fi
[[ "$CXX_AARCH64" == none ]] || say "C++ caller built with: $("${CXX_AARCH64%% *}" --version | head -1)"

# -- sysroot ------------------------------------------------------------------
stage sysroot
SYSROOT=$CACHE/sysroot
GUEST_PY=$SYSROOT/usr/bin/python3.11-qemu
STDLIB_CHECK='import ssl, sqlite3, ctypes, json, gzip, lzma, bz2, zlib, pickle, decimal, hashlib, uuid, readline, subprocess, platform; print(platform.machine(), platform.python_version(), ssl.OPENSSL_VERSION)'

write_wrapper() {  # write_wrapper SYSROOT: the guest python as a host executable
  local root=$1
  {
    echo '#!/bin/sh'
    echo '# Written by tools/check-aarch64.sh: the sysroot'"'"'s arm64 python3.11 under qemu.'
    echo '# -0 "$0" makes this script sys.executable, so subprocesses of it work too.'
    printf 'exec %q -L %q -0 "$0" %q "$@"\n' "$QEMU" "$root" "$root/usr/bin/python3.11"
  } >"$root/usr/bin/python3.11-qemu"
  chmod +x "$root/usr/bin/python3.11-qemu"
}

build_sysroot() {
  local apt_dir=$CACHE/apt debs=$CACHE/debs new=$CACHE/sysroot.new f d
  command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "apt-get and dpkg are needed to build the sysroot"
  rm -rf "$apt_dir/etc" "$apt_dir/lists" "$debs" "$new"
  mkdir -p "$apt_dir/etc/sources.list.d" "$apt_dir/etc/preferences.d" "$apt_dir/lists/partial" \
           "$apt_dir/cache/archives/partial" "$debs" "$new"
  : >"$apt_dir/status"
  # The system's sources, as they are (same archives, same Signed-By keyrings).
  local n=0
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    cp "$f" "$apt_dir/etc/sources.list.d/$(basename "$f" | sed 's/^sources\.list$/system.list/')"
    n=$((n + 1))
  done
  [[ $n -gt 0 ]] || die "no apt sources found in /etc/apt (sources.list, sources.list.d/)"
  APT_OPTS=(
    -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::State::status=$apt_dir/status"
    -o "Dir::Cache=$apt_dir/cache" -o "Dir::Cache::archives=$apt_dir/cache/archives"
    -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/etc/sources.list.d"
    -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$apt_dir/etc/preferences.d"
    -o "APT::Architecture=arm64" -o "APT::Architectures::=arm64"
    -o "Acquire::Languages=none" -o "Debug::NoLocking=1"
    -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::CNF::DefaultEnabled=false"
  )
  # apt drops to the _apt user for downloads, which cannot write to a root-
  # owned cache under $HOME.
  [[ $(id -u) -eq 0 ]] && APT_OPTS+=(-o "APT::Sandbox::User=root")
  say "apt-get update (arm64 package lists into $apt_dir/lists)"
  apt-get "${APT_OPTS[@]}" -q update >&2 || die "apt-get update of the arm64 package lists failed (network? the sources in /etc/apt?)"
  apt-cache "${APT_OPTS[@]}" show python3.11:arm64 >/dev/null 2>&1 \
    || die "the arm64 package lists have no python3.11 (the system's apt sources are not Debian bookworm-like?)"
  local pkgs
  pkgs=$(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
           --no-replaces --no-enhances python3.11 libstdc++6 \
         | grep -v '^ ' | sed 's/:arm64$//' | grep -v '^<' \
         | grep -vxE 'dpkg|tar|install-info|perl|perl-base|perl-modules-[0-9.]+|libperl[0-9.]+|libgdbm-compat4|mailcap|mime-support|debconf' \
         | sort -u) || die "could not resolve python3.11's dependencies for arm64"
  # shellcheck disable=SC2086
  say "downloading $(wc -w <<<"$pkgs") arm64 packages: $(echo $pkgs)"
  # shellcheck disable=SC2086
  (cd "$debs" && apt-get "${APT_OPTS[@]}" -q download $pkgs >&2) || die "apt-get download of the arm64 packages failed"
  for f in "$debs"/*.deb; do
    dpkg -x "$f" "$new" || die "dpkg -x $f failed"
  done
  # Merge /bin, /sbin, /lib into /usr as a bookworm system has them.
  for d in bin sbin lib; do
    if [[ -d "$new/$d" && ! -L "$new/$d" ]]; then
      mkdir -p "$new/usr/$d"
      cp -a "$new/$d/." "$new/usr/$d/"
      rm -rf "${new:?}/$d"
      ln -s "usr/$d" "$new/$d"
    fi
  done
  # An empty loader cache, so that the guest's ld.so never reads the host's
  # /etc/ld.so.cache (qemu -L falls back to host paths missing in the sysroot);
  # it then searches its default directories, /usr/lib/aarch64-linux-gnu.
  : >"$new/etc/ld.so.cache"
  [[ -x "$new/usr/bin/python3.11" ]] || die "the unpacked packages hold no usr/bin/python3.11"
  write_wrapper "$new"
  say "checking the emulated python3.11 in the new sysroot"
  (cd / && PYTHONNOUSERSITE=1 "$new/usr/bin/python3.11-qemu" -c "$STDLIB_CHECK" >&2) \
    || die "the sysroot's python3.11 does not run under $QEMU (above)"
  (cd "$debs" && ls *.deb) >"$new/.complete"
  rm -rf "$SYSROOT"
  mv "$new" "$SYSROOT"
  rm -rf "$debs"  # the sysroot is what is reused
}

if [[ "${GMP_AARCH64_REFRESH:-0}" != 0 || ! -f "$SYSROOT/.complete" ]]; then
  say "building the arm64 sysroot in $SYSROOT"
  mkdir -p "$CACHE"
  build_sysroot
else
  say "reusing $SYSROOT ($(wc -l <"$SYSROOT/.complete") packages; GMP_AARCH64_REFRESH=1 rebuilds it)"
fi
write_wrapper "$SYSROOT"  # the cache may have moved, or qemu

# -- install ------------------------------------------------------------------
stage install
WORK=$(cd "$(mktemp -d "${TMPDIR:-/tmp}/gmp-aarch64.XXXXXX")" && pwd -P)
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site
# Every manylinux tag the sysroot's glibc (2.36) runs: pip expands none of them.
TARGET=(--platform manylinux2014_aarch64 --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:)
for v in $(seq 17 36); do TARGET+=(--platform "manylinux_2_${v}_aarch64"); done
PIP=("$HOST_PY" -m pip -q --disable-pip-version-check)
export PIP_ROOT_USER_ACTION=ignore
# tqdm, pytest and their dependencies (pure Python), downloaded once into the
# cache (later runs need no index), then installed from there.
WHEELS=$CACHE/wheels
if [[ "${GMP_AARCH64_REFRESH:-0}" != 0 || ! -f "$WHEELS/.complete" ]]; then
  say "pip download: tqdm, pytest and their dependencies for aarch64 into $WHEELS"
  rm -rf "$WHEELS"
  "${PIP[@]}" download -d "$WHEELS" "${TARGET[@]}" tqdm pytest >&2 || die "pip could not download tqdm and pytest for aarch64"
  (cd "$WHEELS" && ls ./*.whl) >"$WHEELS/.complete"
fi
say "pip: $(basename "$WHEEL") (--no-deps) into $SITE"
"${PIP[@]}" install --no-warn-script-location --target "$SITE" "${TARGET[@]}" --no-deps "$WHEEL" >&2 \
  || die "pip could not install $WHEEL for cp311 manylinux2014/manylinux_2_17..2_36 aarch64"
say "pip: tqdm, pytest (from $WHEELS)"
"${PIP[@]}" install --no-warn-script-location --upgrade --target "$SITE" "${TARGET[@]}" --no-index --find-links "$WHEELS" tqdm pytest >&2 \
  || die "pip could not install tqdm and pytest from $WHEELS (GMP_AARCH64_REFRESH=1 fetches them again)"

# The emulated Python's environment: nothing from the host's Python settings.
unset PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE PYTHONEXECUTABLE VIRTUAL_ENV
export PYTHONPATH=$SITE PYTHONNOUSERSITE=1 PYTHONSAFEPATH=1
py() { "$GUEST_PY" "$@"; }

# -- import -------------------------------------------------------------------
stage import
out=$(cd "$WORK" && py -c 'import gpumempool, platform; print(platform.machine(), gpumempool.library_path())') \
  || die "import gpumempool failed under emulation (above)"
echo "$out"
[[ $out == aarch64\ * ]] || die "expected 'aarch64 <library path>', got: $out"
[[ $out == *" $SITE/gpumempool/"* ]] || die "gpumempool was not imported from the installed wheel ($SITE): $out"

# -- demo ---------------------------------------------------------------------
stage demo
(cd "$WORK" && py -m gpumempool demo --steps 50 --no-progress) || die "python -m gpumempool demo failed under emulation"

# -- pytest -------------------------------------------------------------------
stage pytest
RUN=$WORK/run
mkdir -p "$RUN"
# tests/ with what its files read from the checkout (tests/../README.md, docs/,
# tests/../benchmarks/), and pyproject.toml for pytest's settings.
cp -r "$HERE/tests" "$HERE/benchmarks" "$HERE/docs" "$HERE/pyproject.toml" "$HERE/README.md" "$RUN/"
for f in "${TEST_FILES[@]}"; do
  [[ -f "$RUN/tests/$f" ]] || die "no tests/$f in $HERE"
done
mkdir -p "$RUN/plugin"
cat >"$RUN/plugin/gmp_aarch64.py" <<'EOF'
"""pytest plugin of tools/check-aarch64.sh: skip the tests that build
tests/csrc helpers (through conftest's fixtures) or C code of their own (a
test body that runs $CC) with a compiler (the host's would make x86_64
objects), unless GMP_AARCH64_CC names an aarch64 C compiler; the C++ and
torch ones always skip."""
import inspect
import os

import pytest

C_HELPERS = {"clib", "fake_cuda", "fake_nccl", "fake_gpu_env"}
# cxx_caller (tests/csrc/torch_caller.cpp) builds with GMP_AARCH64_CXX;
# c10_caller and torch_headers need torch.
ALWAYS = {"c10_caller", "torch_headers"} | (set() if os.environ.get("GMP_AARCH64_CXX_OK") else {"cxx_caller"})


def _runs_cc(item):
    try:
        src = inspect.getsource(item.obj)
    except (AttributeError, OSError, TypeError):
        return False
    return 'environ.get("CC"' in src or "_build_so(" in src


def pytest_collection_modifyitems(config, items):
    have_cc = bool(os.environ.get("GMP_AARCH64_CC"))
    unbuildable = ALWAYS | (set() if have_cc else C_HELPERS)
    for item in items:
        need = sorted(unbuildable & set(getattr(item, "fixturenames", ())))
        if not need and not have_cc and _runs_cc(item):
            need = ["C code of its own"]
        if need:
            item.add_marker(pytest.mark.skip(
                reason=f"builds {', '.join(need)} with a compiler: none for aarch64 here (GMP_AARCH64_CC)"))
EOF
# A compiler call the plugin did not foresee fails loudly, not with an x86_64 .so.
# (GMP_AARCH64_CC is a C compiler; the C++ caller builds with GMP_AARCH64_CXX.)
printf '#!/bin/sh\necho "check-aarch64: no aarch64 compiler here (GMP_AARCH64_CC names a C one)" >&2\nexit 1\n' >"$RUN/plugin/no-cc"
chmod +x "$RUN/plugin/no-cc"
export CC=${GMP_AARCH64_CC:-$RUN/plugin/no-cc} CXX=$RUN/plugin/no-cc
if [[ "$CXX_AARCH64" != none ]]; then
  export CXX=$CXX_AARCH64 GMP_AARCH64_CXX_OK=1
fi
export PYTHONPATH=$SITE:$RUN/plugin
say "running: python -m pytest -q -p no:cacheprovider -p gmp_aarch64 ${TEST_FILES[*]/#/tests/} (emulated: slow, a dot per test)"
rc=0
(cd "$RUN" && timeout "${GMP_AARCH64_TIMEOUT:-1800}" "$GUEST_PY" -m pytest -q -p no:cacheprovider -p gmp_aarch64 \
   -rfEs --durations=10 --junitxml="$WORK/junit.xml" "${TEST_FILES[@]/#/tests/}") || rc=$?
counts=$("$HOST_PY" - "$WORK/junit.xml" <<'EOF' || true
import sys, xml.etree.ElementTree as ET
t = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
for s in ET.parse(sys.argv[1]).getroot().iter("testsuite"):
    for k in t:
        t[k] += int(s.get(k, 0))
passed = t["tests"] - t["failures"] - t["errors"] - t["skipped"]
print(f"{passed} passed, {t['skipped']} skipped, {t['failures']} failed, {t['errors']} errors")
EOF
)
stage ""
say "pytest under emulation: ${counts:-no report} (exit status $rc)"
summary
if [[ $rc -eq 124 ]]; then
  die "pytest ran past GMP_AARCH64_TIMEOUT=${GMP_AARCH64_TIMEOUT:-1800}s"
elif [[ $rc -ne 0 ]]; then
  die "pytest failed under emulation (exit status $rc; 5 means no tests ran)"
fi
say "OK: $(basename "$WHEEL") imports, runs the demo and passes the engine tests on aarch64 (qemu)"
