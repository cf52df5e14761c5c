#!/usr/bin/env bash
# Build the CPython 3.12 wheel of gpumempool that the GPU device machine
# installs (it has Python 3.12 + torch but no Go, so the extension must be
# built here). Runs on the build machine, from any directory:
#
#     bash tools/build-gpu-wheel.sh
#
# Leaves exactly one wheelhouse/gpumempool-*-cp312-*.whl (older gpumempool
# wheels there are removed), plus, when pip can fetch it, a tqdm wheel (pure
# Python: gpumempool depends on tqdm and the device has no internet; it
# usually has tqdm already, through transformers), RMM's wheels for CUDA 13
# in wheelhouse/rmm/ (rmm-cu13 and what it needs beyond numpy, ~15 MB: the
# benchmark suite's `rmm` configuration; gpu-check.sh installs them) and
# wheelhouse/BUILD-INFO
# (commit, dirty files, time). Prints the wheel's path on the last line of
# stdout. wheelhouse/ is git-ignored: carry it to the device machine with the
# run tool's carry=["wheelhouse"], then `bash tools/gpu-check.sh` there.
#
# Needs a CPython 3.12: $GMP_PY312 if set, else python3.12 on PATH, else
# pyenv's 3.12.*. The wheel is the manylinux one users get, built by
# tools/build-wheels.sh (zig for glibc 2.17, Go and zig from PyPI where
# missing, auditwheel) from a copy of the working tree; the checkout is not
# modified apart from the git-ignored wheelhouse/ directory.
#
# Environment: GMP_PY312 (interpreter), GMP_NO_TQDM_WHEEL=1 (don't fetch tqdm),
# GMP_NO_RMM_WHEELS=1 (don't fetch RMM), GMP_RMM_SPEC (default rmm-cu13==26.10.*, the
# release the suite was written against),
# GMP_KEEP_VENV=1 (keep the build virtualenv and print where it is).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELHOUSE=$ROOT/wheelhouse
# shellcheck source=tools/source-digest.sh
. "$ROOT/tools/source-digest.sh"

say() { echo "build-gpu-wheel: $*" >&2; }
die() { echo "build-gpu-wheel: error: $*" >&2; exit 1; }

# -- tools: Go and zig come from PyPI where missing (tools/build-wheels.sh) --
is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; }
PY=""
if [[ -n "${GMP_PY312:-}" ]]; then
  is_py312 "$GMP_PY312" || die "GMP_PY312=$GMP_PY312 is not a working CPython 3.12"
  PY=$(command -v "$GMP_PY312")
else
  candidates=(python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12)
  for p in "${candidates[@]}"; do
    if command -v "$p" >/dev/null 2>&1 && is_py312 "$p"; then
      PY=$(command -v "$p")
      break
    fi
  done
  [[ -n "$PY" ]] || die "no CPython 3.12 found (tried: ${candidates[*]}); set GMP_PY312=/path/to/python3.12"
fi
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

# -- a throwaway build virtualenv -------------------------------------------
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gmp-wheel.XXXXXX")
cleanup() {
  if [[ -n "${GMP_KEEP_VENV:-}" ]]; then say "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
VENV=$TMP/venv
"$PY" -m venv "$VENV"
say "a temporary virtualenv (to check the wheel in and to download with)"

# -- build ----------------------------------------------------------------
# The manylinux wheel users get (tools/build-wheels.sh: zig, glibc 2.17,
# auditwheel), not one linked against this machine's glibc: the GPU check
# then runs what users install.
OUTDIR=$TMP/dist
say "tools/build-wheels.sh for $PY, x86_64 (the Go build takes ~30 s with warm caches, minutes without)"
t0=$SECONDS
if ! GMP_WHEEL_PYTHONS=$PY GMP_WHEEL_ARCHES=x86_64 GMP_WHEEL_TESTS=demo GMP_WHEEL_OUT=$OUTDIR \
    bash "$ROOT/tools/build-wheels.sh" >"$TMP/build.log" 2>&1; then
  tail -n 60 "$TMP/build.log" >&2
  die "tools/build-wheels.sh failed (last 60 lines of its output above)"
fi
shopt -s nullglob
built=("$OUTDIR"/gpumempool-*-cp312-*manylinux*_x86_64.whl)
shopt -u nullglob
[[ ${#built[@]} -eq 1 ]] || { ls -l "$OUTDIR" >&2; die "expected one gpumempool cp312 manylinux wheel in $OUTDIR"; }
say "built $(basename "${built[0]}") in $((SECONDS - t0)) s: $(grep -oE 'manylinux_2_[0-9]+_x86_64' "$OUTDIR/SUMMARY.md" | head -n 1)"

# -- check it: installs, imports outside the checkout, allocates on sim ------
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "${built[0]}"
(cd "$TMP" && PYTHONSAFEPATH=1 "$VENV/bin/python" - <<'EOF') || die "the wheel does not work (see above)"
import os, subprocess, sys
import gpumempool as gmp
from gpumempool import _pool
assert _pool._fast is not None, "the wheel lacks gpumempool._fastcall (MemPool.alloc/free's C fast path)"
p = gmp.MemPool()
p.free(p.alloc(1000))
p.close()
lib = gmp.library_path()
assert "site-packages" in lib, lib
try:
    dyn = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
    needed = [l.split("[", 1)[1].rstrip("]") for l in dyn.splitlines() if "(NEEDED)" in l]
    if any(n.startswith("libpython") for n in needed):
        sys.exit(f"the extension links libpython ({needed}); the device's python may not have it")
    syms = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True).stdout
    import re
    vers = sorted({tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", syms)})
    glibc = ".".join(map(str, vers[-1])) if vers else "?"
    print(f"build-gpu-wheel: wheel OK (sim alloc/free); extension NEEDS {', '.join(needed) or '-'}; "
          f"requires glibc >= {glibc}", file=sys.stderr)
except FileNotFoundError:
    print("build-gpu-wheel: wheel OK (sim alloc/free); readelf/objdump not found, library check skipped", file=sys.stderr)
EOF

# -- wheelhouse/ ------------------------------------------------------------
mkdir -p "$WHEELHOUSE"
rm -f "$WHEELHOUSE"/gpumempool-*.whl
cp "${built[0]}" "$WHEELHOUSE/"
WHEEL=$WHEELHOUSE/$(basename "${built[0]}")

# The backend latency benchmark (benchmarks/gpu_backends.py runs it) is Go,
# and the device machine has no Go: built here for it.
if go build -o "$WHEELHOUSE/backendbench" ./benchmarks/backendbench; then
  say "added wheelhouse/backendbench (benchmarks/gpu_backends.py's latency measurement)"
else
  say "note: could not build benchmarks/backendbench: gpu-check.sh's bench stage will fail"
fi

# fetch_pure_wheel NAME WHAT-FOR IF-MISSING: a pure-Python wheel the device
# (no internet) may lack, downloaded once into the wheelhouse.
fetch_pure_wheel() {
  local have
  shopt -s nullglob
  have=("$WHEELHOUSE"/"$1"-*.whl)
  shopt -u nullglob
  [[ ${#have[@]} -gt 0 ]] && return 0
  if "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 "$1" -d "$WHEELHOUSE" >"$TMP/$1.log" 2>&1; then
    say "added a $1 wheel ($2, for the device, which has no internet)"
  else
    say "note: could not download a $1 wheel (offline?); $3"
  fi
}

# tqdm: gpumempool's dependency, usually on the device already (transformers).
[[ -z "${GMP_NO_TQDM_WHEEL:-}" ]] && fetch_pure_wheel tqdm "a fallback" "the device must already have tqdm"
# pyelftools: the torch oracle reads torch's libraries with it (gpu-check.sh's oracle stage).
fetch_pure_wheel pyelftools "the oracle stage's" "gpu-check.sh's oracle stage will fail"

if [[ -z "${GMP_NO_RMM_WHEELS:-}" ]]; then
  # Resolved for the device (CPython 3.12, x86-64 manylinux); numpy is left
  # out: the device's torch brings one, and rmm needs numpy >= 2 (checked
  # there when it installs).
  rmm_spec=${GMP_RMM_SPEC:-rmm-cu13==26.10.*}
  rm -rf "$WHEELHOUSE/rmm"
  if "$VENV/bin/pip" download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      "$rmm_spec" -d "$WHEELHOUSE/rmm" >"$TMP/rmm.log" 2>&1; then
    rm -f "$WHEELHOUSE"/rmm/numpy-*.whl
    say "added RMM's wheels to wheelhouse/rmm: $(cd "$WHEELHOUSE/rmm" && ls | tr '\n' ' ')"
  else
    rm -rf "$WHEELHOUSE/rmm"
    say "note: could not download $rmm_spec (offline?): the suite's rmm configuration will not run on the device"
    tail -n 5 "$TMP/rmm.log" >&2
  fi
fi

{
  echo "wheel: $(basename "$WHEEL")"
  echo "sha256: $(sha256sum "$WHEEL" | cut -d' ' -f1)"
  echo "sources: $(source_digest)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$PY" -c 'import sys; print(sys.version.split()[0])') and zig (tools/build-wheels.sh; $(grep -oE 'manylinux_2_[0-9]+_x86_64' "$OUTDIR/SUMMARY.md" | head -n 1))"
  if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo none)"
    echo "modified tracked files: $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
    git -C "$ROOT" status --porcelain 2>/dev/null | head -n 40 | sed 's/^/  /'
  fi
} >"$WHEELHOUSE/BUILD-INFO"

say "wheelhouse: $(cd "$WHEELHOUSE" && ls | tr '\n' ' ')($(du -sh "$WHEELHOUSE" | cut -f1))"
say "on the device: run(command=\"bash tools/gpu-check.sh part1\", carry=[\"wheelhouse\"], timeout_s=600), then part2"
echo "$WHEEL"
