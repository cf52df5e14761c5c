#!/usr/bin/env bash
# The GPU suite (tests/test_torch_gpu.py) under two torches on the device
# machine (issue 27, item 5): the machine's own (PY, the gpu-check venv,
# which sees /opt/torch/.venv's torch: 2.11) and a newer one (GMP_TORCH_NEW,
# default 2.15) installed offline into a venv of its own, where a wheel cache
# on the machine has it. The machine has no internet: when no cache holds
# the newer torch, or pip cannot install it from there, the last line says
# so and why, and the newer run is skipped.
#
# tools/gpu-check.sh's torch-versions stage runs it; alone, from the
# repository root:
#   PY=/tmp/gmpvenv/bin/python WHEEL=wheelhouse/gpumempool-...whl bash tools/torch-versions.sh
#
# Environment: PY (required: the python with gpumempool and the machine's
# torch), WORK (logs/ and results/ under it; default /tmp/gmp-check), WHEEL
# (the gpumempool wheel for the new venv; without it the new venv sees PY's
# site-packages), GMP_TORCH_NEW (default 2.15), GMP_TORCH_WHEELS (wheel
# cache directories searched first, colon-separated), GMP_TORCH_PYTEST_T
# (seconds per pytest run, default 200), GMP_TORCH_INSTALL_T (seconds for
# the install, default 150), GMP_TORCH_FIND=0 (do not look for a cache
# beyond the usual directories), GMP_TORCH_VERSIONS_DRY_RUN=1 (print the
# pytest commands instead of running them; the search and install still
# run).
# Writes logs/torch-<version>.log (each pytest run), logs/torch-install.log,
# results/junit-torch-<version>.xml. Exit status: 0 both torches ran and
# passed; 1 a run failed or skipped every test; 99 the machine's torch
# passed (or was a dry run) and the newer one was not run (the reason on the
# last line).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
: "${PY:?PY must name the python with gpumempool and the torch of this machine}"
WORK=${WORK:-/tmp/gmp-check}
NEW=${GMP_TORCH_NEW:-2.15}
PYTEST_T=${GMP_TORCH_PYTEST_T:-200}
INSTALL_T=${GMP_TORCH_INSTALL_T:-150}
NEW_VENV=$WORK/torch-$NEW-venv
mkdir -p "$WORK/logs" "$WORK/results"
export PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1

torch_version() {  # python: its torch's version, or nothing
  (cd /tmp && timeout 60 "$1" -c 'import torch; print(torch.__version__)' 2>/dev/null)
}

# run_suite python label: the GPU suite under python's torch; sets RESULT
# (one line) and returns 0 when it passed (some test passed, none failed).
run_suite() {
  local py=$1 label=$2 log=$WORK/logs/torch-$2.log line rc
  local cmd=("$py" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/results/junit-torch-$label.xml"
             tests/test_torch_gpu.py)
  echo "+ timeout $PYTEST_T ${cmd[*]}"
  if [[ "${GMP_TORCH_VERSIONS_DRY_RUN:-}" == 1 ]]; then
    RESULT="torch $label: dry run, not run"
    return 0
  fi
  timeout -k 10 "$PYTEST_T" "${cmd[@]}" >"$log" 2>&1
  rc=$?
  tail -n 30 "$log"
  line=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran' "$log" | tail -n 1 | tr -d '=' |
         sed 's/^ *//; s/ *$//')
  if ((rc == 0)) && [[ $line == *passed* ]]; then
    RESULT="torch $label: $line"
    return 0
  elif ((rc == 0)); then
    RESULT="torch $label: every test skipped: $line"
  elif ((rc == 124 || rc == 137)); then
    RESULT="torch $label: TIMEOUT after ${PYTEST_T}s (logs/torch-$label.log)"
  else
    RESULT="torch $label: FAILED, exit status $rc: ${line:-no summary} (logs/torch-$label.log)"
  fi
  return 1
}

# find_caches: CACHES, the directories that hold a torch-$NEW wheel, and
# SEARCHED, where it looked.
find_caches() {
  local dirs=() found=() d
  IFS=: read -r -a dirs <<<"${GMP_TORCH_WHEELS:-}"
  dirs+=("${WHEELHOUSE:-$ROOT/wheelhouse}/torch" "${WHEELHOUSE:-$ROOT/wheelhouse}" "$ROOT/shared/wheels"
         /opt/wheels /opt/wheelhouse /opt/torch/wheels /wheels /wheelhouse "$HOME/wheels"
         "$HOME/.cache/gpumempool/wheels")
  SEARCHED="${dirs[*]}"
  for d in "${dirs[@]}"; do
    [[ -n "$d" ]] && compgen -G "$d/torch-$NEW*.whl" >/dev/null && found+=("$d")
  done
  if [[ "${GMP_TORCH_FIND:-1}" != 0 ]]; then
    SEARCHED+=" and find / -xdev -maxdepth 6"
    mapfile -t -O "${#found[@]}" found < <(timeout 30 find / -xdev -maxdepth 6 -name "torch-$NEW*.whl" -printf '%h\n' 2>/dev/null)
  fi
  mapfile -t CACHES < <(printf '%s\n' "${found[@]}" | awk 'NF && !seen[$0]++')
}

# install_new: a venv with torch $NEW from the caches (offline); sets
# RESULT to why not and returns 1 when it cannot.
install_new() {
  local caches=() links=() site ver
  find_caches
  caches=("${CACHES[@]}")
  if [[ ${#caches[@]} -eq 0 ]]; then
    RESULT="torch $NEW: not run: no torch-$NEW*.whl in any wheel cache on this machine (searched: $SEARCHED), and the machine has no internet to download one"
    return 1
  fi
  for d in "${caches[@]}"; do links+=(--find-links "$d"); done
  echo "wheel caches with torch $NEW: ${caches[*]}"
  rm -rf "$NEW_VENV"
  # PY's own site-packages (gpumempool, pytest, the machine's torch and its
  # CUDA libraries) come after the venv's: its torch shadows the machine's.
  if ! timeout 120 "$PY" -m venv --system-site-packages "$NEW_VENV"; then
    RESULT="torch $NEW: not run: could not make a venv at $NEW_VENV (logs/torch-install.log)"
    return 1
  fi
  site=$("$NEW_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" - "$site" <<'EOF'
import os, sys, sysconfig
paths = [p for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")) if os.path.isdir(p)]
with open(os.path.join(sys.argv[1], "_gmp_base_site.pth"), "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in paths) + "\n")
EOF
  local pip=("$NEW_VENV/bin/python" -m pip install --disable-pip-version-check --no-index "${links[@]}")
  echo "+ ${pip[*]} torch==$NEW.*"
  if ! timeout -k 10 "$INSTALL_T" "${pip[@]}" "torch==$NEW.*"; then
    # Its CUDA libraries may be missing from the caches: torch alone then
    # loads the machine's torch's (the same CUDA major release or not).
    echo "+ ${pip[*]} --no-deps torch==$NEW.*   (with its dependencies it did not install)"
    if ! timeout -k 10 "$INSTALL_T" "${pip[@]}" --no-deps "torch==$NEW.*"; then
      RESULT="torch $NEW: not run: pip could not install torch==$NEW.* offline from ${caches[*]} (logs/torch-install.log)"
      return 1
    fi
    echo "note: torch $NEW installed without its dependencies; it uses the machine's CUDA libraries"
  fi
  if [[ -n "${WHEEL:-}" ]]; then
    timeout 120 "${pip[@]}" --no-deps --force-reinstall "$WHEEL" || {
      RESULT="torch $NEW: not run: could not install $WHEEL into $NEW_VENV (logs/torch-install.log)"
      return 1
    }
  fi
  ver=$(torch_version "$NEW_VENV/bin/python")
  if [[ $ver != "$NEW"* ]]; then
    RESULT="torch $NEW: not run: installed, but $NEW_VENV/bin/python imports torch ${ver:-(none: it does not import)}"
    return 1
  fi
  (cd /tmp && "$NEW_VENV/bin/python" -c 'import torch; c = getattr(torch, "cuda", None); print("torch", torch.__version__, "cuda available:", c.is_available() if c else "no torch.cuda")') 2>&1
  NEW_VERSION=$ver
}

status=0
machine_version=$(torch_version "$PY")
if [[ -z "$machine_version" ]]; then
  why=$(cd /tmp && timeout 60 "$PY" -c 'import torch' 2>&1 | tail -n 1)
  echo "the machine's torch: $PY cannot import torch: ${why:-no error printed}"
  exit 1
fi
echo "== the GPU suite under the machine's torch $machine_version ($PY)"
run_suite "$PY" "$machine_version" || status=1
first=$RESULT
echo "$first"

echo "== the GPU suite under torch $NEW, installed offline"
NEW_VERSION=
install_new >"$WORK/logs/torch-install.log" 2>&1
cat "$WORK/logs/torch-install.log"
if [[ -n "$NEW_VERSION" ]]; then
  run_suite "$NEW_VENV/bin/python" "$NEW_VERSION" || status=1
  second=$RESULT
else
  second=$RESULT
  ((status == 0)) && status=99
fi
echo "$second"
echo "$first; $second"
exit "$status"
