#!/usr/bin/env bash
# GPU checks of gpumempool on the device machine (one H100/H200, Python 3.12
# with torch, CuPy, NCCL, transformers, pytest; no Go, no internet). Runs
# from the repository root there, with $OUT set by the run tool.
#
# 1. Here (the build machine, which has Go):   bash tools/build-gpu-wheel.sh
#    -> wheelhouse/gpumempool-*-cp312-*.whl (git-ignored, so it must be carried)
#    The first call on any GPU machine (issue 29): the critical run, one call
#    of under nine minutes, the wheel install included:
#      run(command="bash tools/gpu-check.sh critical", carry=["wheelhouse"], timeout_s=600)
#    `bash tools/gpu-check.sh --plan critical` prints what it would run (no
#    wheel or GPU needed).
# 2. With the run tool, two calls of < 10 minutes each (each call starts a
#    fresh machine, so each installs the wheel again; ~10 s):
#      run(command="bash tools/gpu-check.sh part1", carry=["wheelhouse"], timeout_s=600)
#      run(command="bash tools/gpu-check.sh part2", carry=["wheelhouse"], timeout_s=600)
#      run(command="bash tools/gpu-check.sh part3", carry=["wheelhouse"], timeout_s=600)
#    or name stages: run(command="bash tools/gpu-check.sh gputests bench", carry=["wheelhouse"])
# 3. Back here, under the reply's files_at: summary.md (read this first),
#    gpu-check.tar.gz (logs/, results/), traces.tar.gz (recorded traces and
#    their replay summary) and snapshots.tar (torch's raw snapshots, when
#    they fit). The run tool returns at most 8 files, hence the archives.
#    tar -xzf .../gpu-check.tar.gz -C /tmp/gpu && cp /tmp/gpu/results/*.{md,json,png} benchmarks/results/
#    tar -xzf .../traces.tar.gz -C /tmp/gpu && cp /tmp/gpu/traces/*.trace.gz benchmarks/traces/
#
# Stages (each under `timeout`, logging to logs/<stage>.log; a failure is
# recorded and the next stage runs):
#   info       python -m gpumempool info --json, nvidia-smi, versions          (~10 s)
#   gputests   pytest -m gpu tests: every gpu-marked test of the suite         (~1-3 min)
#              (test_gpu.py, test_torch_gpu.py, the short gpu_stress run of
#              test_gpu_scripts.py, a forked child of a CUDA pool in test_fork.py)
#   cputests   pytest -m "not gpu" tests (the rest of the suite)              (~30-60 s)
#   tests      pytest tests (the whole suite, GPU tests included)             (~2-4 min)
#   bench      benchmarks/gpu_backends.py (raw vs cached, per backend)       (~1-3 min)
#   gpt2       benchmarks/gpt2_train.py (mempool vmm/nccl, replacement loop) (~2-4 min)
#   traces     benchmarks/record_traces.py (GPT-2 train, CNN, inference)     (~1-3 min)
#   suite      benchmarks/suite_gpu.py (native/async/gmp/CuPy + replays)     (~3-5 min)
#   sanitizer  compute-sanitizer memcheck over cuda/vmm/async pools + CuPy   (~1-2 min)
#   tune       benchmarks/tune_proof.py: record 4 workloads with torch, run    (~6-9 min)
#              `gpumempool tune` on each, then measure torch's max_memory_reserved
#              under the default and the best settings in fresh processes
#              (issue 20: prediction within 1%)
#   oracle     benchmarks/oracle_gpu.py: the torch oracle's traces on the GPU (~2-3 min)
#              and on the fake CUDA stack (needs cc), every event compared
#   stress     benchmarks/gpu_stress.py: threads x streams on cuda, vmm,      (~5-6 min)
#              vmm-expandable and async, tags checked on the GPU (~3.5 min),
#              then its short mode under compute-sanitizer memcheck (~1 min)
#   torch-versions  tools/torch-versions.sh: tests/test_torch_gpu.py under     (~2-8 min)
#              the machine's torch (2.11), then under torch 2.15 installed
#              offline from a wheel cache on the machine into a venv of its
#              own (GMP_TORCH_NEW, GMP_TORCH_WHEELS); no cache with it, or
#              no offline install: skipped, the reason in the detail
# Groups: critical = info gputests tune oracle gpt2 (issue 29: what changed since
#                    the last H100 run, by value; short forms of tune, oracle
#                    and gpt2 (CRITICAL_ARGS); each stage has a budget
#                    (CRITICAL_BUDGET) and is skipped, not half-run, when
#                    what is left of the call cannot hold it; the deadline is
#                    530 s, so the call ends within nine minutes)
#         part1 = info gputests bench sanitizer cputests
#         part2 = info traces gpt2 suite          (suite also replays the traces just recorded)
#         part3 = info stress gpt2 suite          (stress takes most of one call: what is left runs)
#         part4 = info tune                       (the tune proof takes most of one call)
#         part5 = info torch-versions             (issue 27: the GPU suite under two torches)
#         all   = every stage but `tests` (the default; the deadline skips what does not fit)
# The whole invocation stops starting stages at GMP_CHECK_DEADLINE seconds
# (default 570, for the run tool's 600-s limit) and caps each stage's
# timeout to what is left; summary.md and the archives are rewritten after
# every stage, so a run that is killed still returns what it finished.
#
# Environment: PYTHON (base interpreter, default python3: must be 3.12),
# GMP_WHEELHOUSE (default ./wheelhouse), GMP_VENV (default /tmp/gmpvenv),
# GMP_WORK (default /tmp/gmp-check: logs/results/traces, kept between calls on
# a warm machine), GMP_CHECK_DEADLINE, GMP_T_<STAGE> (a stage's time budget in
# seconds, e.g. GMP_T_SUITE=400), GMP_GPT2_ARGS / GMP_TRACES_ARGS /
# GMP_SUITE_ARGS / GMP_TUNE_ARGS / GMP_BENCH_ARGS / GMP_PYTEST_ARGS / GMP_STRESS_ARGS (extra
# arguments; GMP_STRESS_ARGS for the full stress run, not the memcheck one),
# GMP_ORACLE_ARGS, GMP_STRESS_SECONDS (seconds per backend of the stress run, default 45),
# GMP_SKIP_UNFIT=1 (skip a stage whose budget exceeds what is left, as
# `critical` does, instead of running it under a shorter timeout),
# GMP_STRESS_SANITIZER_T (cap on its memcheck run in seconds, default 120),
# GMP_ALLOW_STALE_WHEEL=1 (run a wheel built from other sources than the
# checkout's; refused otherwise, see tools/source-digest.sh).
# Exit status: 0 every stage of this call ok; 1 some stage failed, timed out,
# was skipped or (pytest) skipped every test; 2 bad arguments; 3 no usable
# wheel or Python (summary.md says which).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
T_START=$SECONDS
# shellcheck source=tools/source-digest.sh
. "$ROOT/tools/source-digest.sh"

ALL_STAGES=(info gputests cputests tests bench gpt2 traces suite sanitizer stress tune oracle torch-versions)
declare -A BUDGET=([info]=60 [gputests]=300 [cputests]=180 [tests]=420 [bench]=300 [gpt2]=360
                   [traces]=300 [suite]=420 [sanitizer]=240 [stress]=420 [tune]=540 [oracle]=240
                   [torch-versions]=540)
declare -A STAGE_GROUPS=([part1]="info gputests bench sanitizer cputests"
                         [part2]="info traces gpt2 suite"
                         [part3]="info stress gpt2 suite"
                         [part4]="info tune"
                         [part5]="info torch-versions"
                         [critical]="info gputests tune oracle gpt2"
                         [all]="info gputests bench traces gpt2 suite sanitizer stress cputests")

# The critical run (issue 29): each stage's budget in seconds, and the short
# form of the long stages. H100 figures of 2026-11-22: info 10 s, gputests
# 83 s; the full gpt2 stage took 186 s for 300 steps x 3 rounds. The budgets
# add up to 500 s: with the wheel install (~20 s) and the 10-s margin they
# fill the 530-s deadline, so every stage runs when each keeps its budget.
declare -A CRITICAL_BUDGET=([info]=30 [gputests]=150 [tune]=160 [oracle]=75 [gpt2]=85)
declare -A CRITICAL_ARGS=(
  [tune]="--workloads cnn-train,gpt2-infer --top 1 --steps 15 --requests 40 --timeout 80"
  [oracle]="--quick"
  [gpt2]="--steps 30 --warmup 5 --rounds 1 --loop-ops 2000 --timeout 60")

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# -- arguments ----------------------------------------------------------------
STAGES=()
PLAN=0
CRITICAL=0
[[ $# -eq 0 ]] && set -- all
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --plan) PLAN=1; continue ;;
    critical) CRITICAL=1 ;;
  esac
  if [[ -n "${STAGE_GROUPS[$arg]:-}" ]]; then
    for s in ${STAGE_GROUPS[$arg]}; do STAGES+=("$s"); done
  elif [[ -n "${BUDGET[$arg]:-}" ]]; then
    STAGES+=("$arg")
  else
    echo "gpu-check: unknown stage or group '$arg'; stages: ${ALL_STAGES[*]}; groups: ${!STAGE_GROUPS[*]}" >&2
    exit 2
  fi
done
# de-duplicate, keeping the order
declare -A _seen=()
_uniq=()
for s in "${STAGES[@]}"; do [[ -z "${_seen[$s]:-}" ]] && _uniq+=("$s") && _seen[$s]=1; done
STAGES=("${_uniq[@]}")
((${#STAGES[@]} == 0)) && read -ra STAGES <<<"${STAGE_GROUPS[all]}"  # only --plan was given

if ((CRITICAL)); then
  # the critical run's budgets and short forms, unless the caller set them
  for s in "${!CRITICAL_BUDGET[@]}"; do BUDGET[$s]=${CRITICAL_BUDGET[$s]}; done
  : "${GMP_TUNE_ARGS=${CRITICAL_ARGS[tune]}}" "${GMP_ORACLE_ARGS=${CRITICAL_ARGS[oracle]}}"
  : "${GMP_GPT2_ARGS=${CRITICAL_ARGS[gpt2]}}" "${GMP_CHECK_DEADLINE=530}" "${GMP_SKIP_UNFIT=1}"
  export GMP_TUNE_ARGS GMP_ORACLE_ARGS GMP_GPT2_ARGS GMP_CHECK_DEADLINE GMP_SKIP_UNFIT
fi

stage_budget() {  # the stage's budget in seconds (GMP_T_<STAGE> overrides)
  local var="GMP_T_${1^^}"
  var=${var//-/_}  # GMP_T_TORCH_VERSIONS
  echo "${!var:-${BUDGET[$1]}}"
}

# Why a stage cannot start with elapsed seconds of the call used (nothing:
# it can), and the timeout it gets otherwise: the one rule run_stage and
# --plan follow. Sets FIT_WHY and FIT_T.
stage_fit() {  # stage elapsed
  local budget left
  budget=$(stage_budget "$1")
  left=$(( ${GMP_CHECK_DEADLINE:-570} - $2 - 10 ))
  FIT_WHY="" FIT_T=$(( budget < left ? budget : left ))
  if (( left < 30 )); then
    FIT_WHY="no time left in this call (${2}s used)"
  elif [[ ${GMP_SKIP_UNFIT:-0} == 1 ]] && (( budget > left )); then
    FIT_WHY="needs ${budget}s, ${left}s left in this call"
  fi
}

if ((PLAN)); then  # what this call would run, in order; needs no wheel or GPU
  # as if the install took PLAN_INSTALL_S and each stage its whole budget
  total=0 at=${GMP_PLAN_INSTALL_S:-20}
  for s in "${STAGES[@]}"; do
    b=$(stage_budget "$s")
    total=$((total + b))
    stage_fit "$s" "$at"
    if [[ -n $FIT_WHY ]]; then
      echo "plan: $s skipped: $FIT_WHY"
      continue
    fi
    at=$((at + FIT_T))
    case $s in
      tune) extra=${GMP_TUNE_ARGS:-} ;; oracle) extra=${GMP_ORACLE_ARGS:-} ;; gpt2) extra=${GMP_GPT2_ARGS:-} ;;
      gputests|cputests|tests) extra=${GMP_PYTEST_ARGS:-} ;; bench) extra=${GMP_BENCH_ARGS:-} ;;
      traces) extra=${GMP_TRACES_ARGS:-} ;; suite) extra=${GMP_SUITE_ARGS:-} ;; *) extra="" ;;
    esac
    echo "plan: $s budget ${b}s$( ((FIT_T < b)) && echo " (timeout ${FIT_T}s: what is left)")${extra:+ args: $extra}"
  done
  echo "plan: budgets ${total}s in all; deadline ${GMP_CHECK_DEADLINE:-570}s; $([[ ${GMP_SKIP_UNFIT:-0} == 1 ]] && echo "a stage that does not fit what is left is skipped" || echo "a stage gets what is left when its budget does not fit")"
  exit 0
fi

if [[ -z "${OUT:-}" ]]; then
  OUT=/tmp/gpu-check-out
  echo "gpu-check: \$OUT is not set (the run tool sets it); writing to $OUT" >&2
fi
mkdir -p "$OUT"
WORK=${GMP_WORK:-/tmp/gmp-check}
mkdir -p "$WORK/logs" "$WORK/results" "$WORK/traces"
STATUS=$WORK/status.tsv
touch "$STATUS"
BASE_PY=${PYTHON:-python3}
VENV=${GMP_VENV:-/tmp/gmpvenv}
WHEELHOUSE=${GMP_WHEELHOUSE:-$ROOT/wheelhouse}
RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
NOTES=$WORK/notes.txt
: >"$NOTES"

log() { echo "gpu-check [$((SECONDS - T_START))s]: $*" >&2; }
note() { echo "$*" >>"$NOTES"; log "$*"; }

set_status() {  # stage result seconds detail
  local tmp detail
  detail=$(printf '%s' "${4:-}" | tr '\t\n' '  ')
  tmp=$(mktemp)
  awk -F'\t' -v s="$1" '$1 != s' "$STATUS" >"$tmp"
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$RUN_ID" "$detail" >>"$tmp"
  mv "$tmp" "$STATUS"
}

# -- summary.md and the archives (rewritten after every stage) -----------------
finish() {
  "$BASE_PY" - "$WORK" "$OUT" "$RUN_ID" "$ROOT" <<'PYEOF' || echo "gpu-check: could not write summary.md" >&2
import os, sys, glob, re
work, out, run_id, root = sys.argv[1:5]
def read(p, limit=None):
    try:
        with open(p, errors="replace") as f:
            t = f.read()
    except OSError:
        return ""
    return t if limit is None else t[-limit:]
rows = [l.rstrip("\n").split("\t") for l in read(os.path.join(work, "status.tsv")).splitlines() if l.strip()]
L = ["# gpumempool GPU check", ""]
env = read(os.path.join(work, "env.txt")).strip()
if env:
    L += ["```", env, "```", ""]
notes = read(os.path.join(work, "notes.txt")).strip()
if notes:
    L += ["Notes:", ""] + [f"* {n}" for n in notes.splitlines()] + [""]
L += ["| stage | result | seconds | run | detail |", "|---|---|---:|---|---|"]
for r in rows:
    r += [""] * (5 - len(r))
    mark = r[1] if r[1] == "ok" else f"**{r[1]}**"
    L.append(f"| {r[0]} | {mark} | {r[2]} | {r[3]}{' (this run)' if r[3] == run_id else ''} | {r[4]} |")
L.append("")
for r in rows:
    stage, result = r[0], r[1]
    lg = os.path.join(work, "logs", f"{stage}.log")
    text = read(lg)
    if stage in ("gputests", "cputests", "tests") and text:
        skips = [l for l in text.splitlines() if l.startswith(("SKIPPED", "FAILED", "ERROR"))]
        final = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)|no tests ran", l)][-1:]
        L += [f"## {stage}: {result}", "", "```"] + final + skips[:60] + ["```", ""]
    if result != "ok" and text:
        L += [f"### {stage} log (last 60 lines of logs/{stage}.log)", "", "```"] + text.splitlines()[-60:] + ["```", ""]
for md in sorted(glob.glob(os.path.join(work, "results", "*.md")) + glob.glob(os.path.join(work, "traces", "*.md"))):
    L += [f"## {os.path.relpath(md, work)}", "", read(md).strip(), ""]
L += ["## Files", ""]
for f in sorted(os.listdir(out)):
    if f != "summary.md":
        L.append(f"* `{f}` ({os.path.getsize(os.path.join(out, f)) / 2**20:.2f} MiB)")
open(os.path.join(out, "summary.md"), "w").write("\n".join(L) + "\n")
PYEOF
}

pack() {
  local max=$((15 * 1024 * 1024))
  rm -f "$OUT/gpu-check.tar.gz" "$OUT/traces.tar.gz" "$OUT/snapshots.tar"
  (cd "$WORK" && tar -czf "$OUT/gpu-check.tar.gz" --exclude='*.pickle.gz' logs results status.tsv notes.txt \
      $(ls env.txt sanitize_backends.py 2>/dev/null)) 2>/dev/null
  if compgen -G "$WORK/traces/*" >/dev/null; then
    (cd "$WORK" && tar -czf "$OUT/traces.tar.gz" --exclude='raw' traces) 2>/dev/null
  fi
  if compgen -G "$WORK/traces/raw/*.pickle.gz" >/dev/null; then
    (cd "$WORK/traces" && tar -cf "$OUT/snapshots.tar" raw) 2>/dev/null
  fi
  for f in "$OUT"/gpu-check.tar.gz "$OUT"/traces.tar.gz "$OUT"/snapshots.tar; do
    if [[ -f "$f" && $(stat -c %s "$f") -gt $max ]]; then
      rm -f "$f"
      grep -qF "dropped $(basename "$f")" "$NOTES" || note "dropped $(basename "$f"): larger than 15 MiB (the run tool returns files up to 16 MiB)"
    fi
  done
  finish
  pack_done=1
}

fail_early() {  # message: no stage can run
  note "ERROR: $*"
  for s in "${STAGES[@]}"; do set_status "$s" "not run" 0 "setup failed"; done
  pack
  echo "gpu-check: error: $*" >&2
  exit 3
}

# -- the wheel ----------------------------------------------------------------
shopt -s nullglob
WHEELS=("$WHEELHOUSE"/gpumempool-*cp312*.whl)
shopt -u nullglob
if [[ ${#WHEELS[@]} -eq 0 ]]; then
  fail_early "no wheel: $WHEELHOUSE/gpumempool-*cp312*.whl not found. The device has no Go, so the extension is built on the build machine: run \`bash tools/build-gpu-wheel.sh\` there and pass carry=[\"wheelhouse\"] to the run tool (wheelhouse/ is git-ignored and does not travel otherwise)."
fi
if [[ ${#WHEELS[@]} -gt 1 ]]; then
  fail_early "several gpumempool cp312 wheels in $WHEELHOUSE (${WHEELS[*]}); keep one (tools/build-gpu-wheel.sh does)"
fi
WHEEL=${WHEELS[0]}
built_from=$(sed -n 's/^sources: //p' "$WHEELHOUSE/BUILD-INFO" 2>/dev/null)
checkout=$(source_digest)
if [[ "$built_from" != "$checkout" ]]; then
  stale_msg="the wheel was built from other sources (${built_from:-unknown: no 'sources:' in $WHEELHOUSE/BUILD-INFO}) than the checkout's ($checkout): its Go, C and Python code is not what would be tested. Rebuild it with \`bash tools/build-gpu-wheel.sh\` (or set GMP_ALLOW_STALE_WHEEL=1)"
  if [[ "${GMP_ALLOW_STALE_WHEEL:-}" == 1 ]]; then
    note "WARNING: $stale_msg"
  else
    fail_early "$stale_msg"
  fi
fi

if ! "$BASE_PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
  fail_early "$BASE_PY is not a CPython 3.12 ($("$BASE_PY" --version 2>&1)); the wheel is cp312. Set PYTHON=..."
fi

# -- install into a virtualenv that sees the base interpreter's packages ------
install_wheel() {
  local sha site parent
  sha=$(sha256sum "$WHEEL" | cut -d' ' -f1)
  if [[ -x "$VENV/bin/python" && "$(cat "$VENV/.gmp-wheel-sha" 2>/dev/null)" == "$sha" ]]; then
    echo "reusing $VENV (same wheel)"
    return 0
  fi
  rm -rf "$VENV"
  if "$BASE_PY" -m venv --system-site-packages "$VENV"; then
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  else
    echo "python -m venv failed; making one without pip and installing with the base pip"
    rm -rf "$VENV"
    "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  fi
  # --system-site-packages reaches the *base* interpreter's site-packages; when
  # python3 is itself a virtualenv (/opt/torch/.venv: torch, CuPy...), add its
  # site-packages too (after ours, .pth files inside processed).
  parent=$("$BASE_PY" - <<'EOF'
import sys, sysconfig
if sys.prefix != sys.base_prefix:
    seen = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths()[key]
        if p not in seen:
            seen.append(p)
    print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in seen))
EOF
)
  if [[ -n "$parent" ]]; then
    echo "$parent" >"$site/_gmp_parent_site.pth"
    echo "added the base virtualenv's site-packages: $parent"
  fi
  venv_pip_install "$WHEEL" || return 1
  echo "$sha" >"$VENV/.gmp-wheel-sha"
}

venv_pip_install() {  # wheel: offline, without dependencies; replaces an install of the same version
  if [[ -x "$VENV/bin/pip" ]]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --force-reinstall "$1"
  else
    "$BASE_PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade --target \
      "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" "$1"
  fi
}

{
  echo "== install $(basename "$WHEEL") into $VENV (base: $(command -v "$BASE_PY"))"
  install_wheel
} >"$WORK/logs/install.log" 2>&1 || { cat "$WORK/logs/install.log" >&2; fail_early "installing the wheel failed (logs/install.log)"; }
PY=$VENV/bin/python
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1
# tqdm: a dependency of gpumempool (the demo's progress bar) that pip --no-deps skips
if ! "$PY" -c 'import tqdm' 2>/dev/null; then
  shopt -s nullglob
  tq=("$WHEELHOUSE"/tqdm-*.whl)
  shopt -u nullglob
  if [[ ${#tq[@]} -gt 0 ]] && venv_pip_install "${tq[0]}" >>"$WORK/logs/install.log" 2>&1; then
    note "tqdm was missing; installed $(basename "${tq[0]}") from the wheelhouse"
  else
    note "tqdm is missing and no wheelhouse/tqdm-*.whl could be installed: \`python -m gpumempool demo\` (with its progress bar) and the CLI tests that use it will fail"
  fi
fi
# RMM (wheelhouse/rmm, from tools/build-gpu-wheel.sh): the suite's rmm configuration
if compgen -G "$WHEELHOUSE/rmm/rmm_*.whl" >/dev/null && ! (cd /tmp && "$PY" -c 'import rmm') 2>/dev/null; then
  if (cd /tmp && "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELHOUSE/rmm" \
        "$(basename "$(compgen -G "$WHEELHOUSE/rmm/rmm_*.whl" | head -n 1)" | cut -d- -f1 | tr _ -)") \
        >>"$WORK/logs/install.log" 2>&1 && (cd /tmp && "$PY" -c 'import rmm') >>"$WORK/logs/install.log" 2>&1; then
    note "installed RMM from wheelhouse/rmm"
  else
    note "RMM's wheels in wheelhouse/rmm did not install or import (logs/install.log): the suite's rmm configuration is not run"
  fi
fi
if ! (cd /tmp && "$PY" -c 'import gpumempool, sys; sys.exit(0 if "site-packages" in gpumempool.__file__ else 1)') >>"$WORK/logs/install.log" 2>&1; then
  cat "$WORK/logs/install.log" >&2
  fail_early "the installed wheel does not import (logs/install.log)"
fi
# is the wheel's Python code the checkout's? (a wheel built before later edits to gpumempool/)
stale=$(cd /tmp && "$PY" - "$ROOT" <<'EOF'
import hashlib, os, sys, gpumempool
inst = os.path.dirname(gpumempool.__file__)
src = os.path.join(sys.argv[1], "gpumempool")
h = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
diff = [f for f in sorted(os.listdir(src)) if f.endswith(".py")
        and (not os.path.exists(os.path.join(inst, f)) or h(os.path.join(src, f)) != h(os.path.join(inst, f)))]
print(" ".join(diff))
EOF
)
[[ -n "$stale" ]] && note "WARNING: the wheel's gpumempool/ differs from the checkout's in: $stale (rebuild it with tools/build-gpu-wheel.sh; the wheel's code is what ran)"
{
  echo "run $RUN_ID on $(uname -n); stages asked: ${STAGES[*]}"
  echo "wheel: $(basename "$WHEEL") sha256 $(sha256sum "$WHEEL" | cut -c1-16)"
  [[ -f "$WHEELHOUSE/BUILD-INFO" ]] && sed 's/^/  /' "$WHEELHOUSE/BUILD-INFO"
  echo "checkout: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: nvidia-smi not found"
  fi
  (cd /tmp && "$PY" - <<'EOF'
import sys
print("python", sys.version.split()[0], sys.executable)
for m in ("gpumempool", "torch", "cupy", "transformers", "numpy", "pytest", "matplotlib", "tqdm", "rmm"):
    try:
        mod = __import__(m)
        extra = f" (CUDA {mod.version.cuda}, cuda available: {mod.cuda.is_available()})" if m == "torch" else ""
        print(f"{m} {getattr(mod, '__version__', '?')}{extra}")
    except Exception as exc:
        print(f"{m}: not importable ({exc.__class__.__name__}: {exc})")
EOF
  ) 2>&1
  echo "compute-sanitizer: $(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo 'not found')"
  echo "cc: $(command -v cc || command -v gcc || echo 'not found (the tests build small C helpers)')"
  echo "c++: $(command -v c++ || command -v g++ || echo 'not found (the tests build C++ callers; oom_error="torch" builds its shim)')"
} >"$WORK/env.txt" 2>&1
log "installed $(basename "$WHEEL") into $VENV; stages: ${STAGES[*]}"

# -- stages -------------------------------------------------------------------
# A module that fails to import must not end the session for the others.
PYTEST_EXTRA=(-p no:cacheprovider --continue-on-collection-errors)
"$PY" -c 'import pytest_timeout' 2>/dev/null && PYTEST_EXTRA+=(--timeout=240)

stage_cmd() {  # the stage's command, run from the repository root
  case "$1" in
    info)
      nvidia-smi || true
      "$PY" -m gpumempool info
      "$PY" -m gpumempool info --json >"$WORK/results/info.json" && cat "$WORK/results/info.json" ;;
    gputests)
      "$PY" -m pytest -m gpu -q -rs "${PYTEST_EXTRA[@]}" --junitxml="$WORK/results/junit-gputests.xml" \
        tests ${GMP_PYTEST_ARGS:-} ;;
    cputests)
      "$PY" -m pytest -m "not gpu" -q -rs "${PYTEST_EXTRA[@]}" --junitxml="$WORK/results/junit-cputests.xml" \
        tests ${GMP_PYTEST_ARGS:-} ;;
    tests)
      "$PY" -m pytest -q -rs "${PYTEST_EXTRA[@]}" --junitxml="$WORK/results/junit-tests.xml" tests ${GMP_PYTEST_ARGS:-} ;;
    bench)
      "$PY" benchmarks/gpu_backends.py --out "$WORK/results" ${GMP_BENCH_ARGS:-} ;;
    gpt2)
      "$PY" benchmarks/gpt2_train.py --out "$WORK/results" ${GMP_GPT2_ARGS:-} ;;
    traces)
      "$PY" benchmarks/record_traces.py --out "$WORK/traces" ${GMP_TRACES_ARGS:-} ;;
    suite)
      local tr=(--traces "$ROOT/benchmarks/traces")
      compgen -G "$WORK/traces/*.trace.gz" >/dev/null && tr+=(--traces "$WORK/traces")
      "$PY" benchmarks/suite_gpu.py --out "$WORK/results" "${tr[@]}" ${GMP_SUITE_ARGS:-} ;;
    tune)
      "$PY" benchmarks/tune_proof.py --out "$WORK/results" ${GMP_TUNE_ARGS:-} ;;
    oracle)
      if ! "$PY" -c 'import elftools' 2>/dev/null; then
        local elf
        elf=$(compgen -G "$WHEELHOUSE/pyelftools-*.whl" | head -1)
        [[ -n "$elf" ]] && venv_pip_install "$elf"
      fi
      "$PY" benchmarks/oracle_gpu.py --out "$WORK/results" ${GMP_ORACLE_ARGS:-} ;;
    sanitizer)
      run_sanitizer ;;
    stress)
      run_stress ;;
    torch-versions)
      bash "$ROOT/tools/torch-versions.sh" ;;
  esac
}

sanitizer_path() {  # compute-sanitizer's path, or nothing
  local cs
  cs=$(command -v compute-sanitizer || true)
  [[ -z "$cs" && -x /usr/local/cuda/bin/compute-sanitizer ]] && cs=/usr/local/cuda/bin/compute-sanitizer
  echo "$cs"
}

run_sanitizer() {
  local cs
  cs=$(sanitizer_path)
  if [[ -z "$cs" ]]; then
    echo "compute-sanitizer not found: skipped"
    return 99
  fi
  cat >"$WORK/sanitize_backends.py" <<'EOF'
"""Allocate and free through gpumempool's cuda/vmm/async pools, write every
byte with a CuPy kernel and read it back; run under compute-sanitizer."""
import sys
import numpy as np
import cupy as cp
import gpumempool as gmp

cp.cuda.set_allocator(None)  # no CuPy pool: only our blocks and CuPy's own plain allocations
cp.cuda.set_pinned_memory_allocator(None)
fill = cp.RawKernel(r'''
extern "C" __global__ void fill(unsigned char* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = (unsigned char)(i * 7u + seed);
}''', "fill")

def check(pool, ptr, n, seed):
    mem = cp.cuda.UnownedMemory(ptr, n, owner=None, device_id=0)
    arr = cp.ndarray((n,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    fill((min(1024, (n + 255) // 256),), (256,), (arr, cp.uint64(n), cp.uint32(seed)))
    got = cp.asnumpy(arr)
    want = ((np.arange(n, dtype=np.uint64) * 7 + seed) & 0xFF).astype(np.uint8)
    assert np.array_equal(got, want), f"{pool.config()['backend']}: wrong bytes in a block of {n}"

sizes = [512, 4097, 1 << 20, (3 << 20) + 7, 16 << 20]
failed = []
for backend, opts in (("cuda", {}), ("vmm", {}), ("vmm", {"expandable": True}), ("async", {})):
    label = backend + ("-expandable" if opts else "")
    try:
        with gmp.MemPool(backend, device=0, name=f"sanitize-{label}", **opts) as pool:
            for rnd in range(2):  # the second round is served from the cache
                ptrs = [pool.alloc(n) for n in sizes]
                for i, (p, n) in enumerate(zip(ptrs, sizes)):
                    check(pool, p, n, 13 * rnd + i)
                cp.cuda.Device(0).synchronize()
                for p in ptrs:
                    pool.free(p)
            s = pool.stats()
            pool.empty_cache()
            print(f"{label}: ok ({s['num_device_alloc']} segment allocations, {s['num_cache_hits']} cache hits)", flush=True)
    except Exception as exc:
        failed.append(label)
        print(f"{label}: FAILED {exc!r}", flush=True)
sys.exit(1 if failed else 0)
EOF
  echo "+ $cs --tool memcheck --leak-check full --error-exitcode 7 $PY sanitize_backends.py"
  local log=$WORK/logs/sanitizer.raw rc
  mkdir -p "$WORK/logs"
  (cd /tmp && "$cs" --tool memcheck --leak-check full --error-exitcode 7 --print-limit 100 "$PY" "$WORK/sanitize_backends.py") 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  # Some runtimes (an H200 under gVisor) do not let compute-sanitizer attach:
  # that is the machine's limit, not a finding.
  if grep -q "Device not supported" "$log"; then
    echo "compute-sanitizer does not support this device/runtime: skipped"
    return 99
  fi
  return "$rc"
}

run_stress() {
  # The stress run (a child process per backend; ~50 s each), then its short
  # mode in one process under memcheck: the stage fails if either does. The
  # memcheck run is capped (GMP_STRESS_SANITIZER_T, default 120 s) so that a
  # slow sanitizer leaves the first run's results and a clear cause.
  local rc=0 src cs log=$WORK/logs/stress-sanitizer.raw md=$WORK/results/gpu_stress_sanitizer.md
  rm -f "$WORK"/results/gpu_stress.{md,json} "$WORK"/results/gpu_stress_sanitizer.{md,json}
  "$PY" benchmarks/gpu_stress.py --out "$WORK/results" --seconds "${GMP_STRESS_SECONDS:-45}" ${GMP_STRESS_ARGS:-} || rc=$?
  echo "== gpu_stress.py: exit status $rc"
  cs=$(sanitizer_path)
  if [[ -z "$cs" ]]; then
    echo "compute-sanitizer not found: the memcheck run is skipped"
    printf '# gpu_stress under compute-sanitizer\n\nskipped: compute-sanitizer not found\n' >"$md"
    return "$rc"
  fi
  echo "+ $cs --tool memcheck --leak-check full --error-exitcode 7 $PY gpu_stress.py --sanitizer-friendly"
  (cd /tmp && timeout -k 10 "${GMP_STRESS_SANITIZER_T:-120}" "$cs" --tool memcheck --leak-check full \
      --error-exitcode 7 --print-limit 100 "$PY" "$ROOT/benchmarks/gpu_stress.py" --sanitizer-friendly \
      --out "$WORK/results" --stem gpu_stress_sanitizer) 2>&1 | tee "$log"
  src=${PIPESTATUS[0]}
  [[ -f "$md" ]] || printf '# gpu_stress under compute-sanitizer\n\nno report written\n' >"$md"
  {
    echo
    if grep -q "Device not supported" "$log"; then
      src=0
      echo "compute-sanitizer does not support this device/runtime: not checked"
    else
      case $src in
        0) echo "Run under \`compute-sanitizer --tool memcheck --leak-check full\`: exit status 0." ;;
        7) echo "**compute-sanitizer memcheck found errors** (exit status 7; logs/stress-sanitizer.raw)." ;;
        124|137) echo "**The memcheck run timed out** after ${GMP_STRESS_SANITIZER_T:-120} s (logs/stress-sanitizer.raw)." ;;
        1) echo "Memcheck's verdict below; **the short run missed a goal** (its table above)." ;;
        *) echo "**The memcheck run failed** with exit status $src (logs/stress-sanitizer.raw)." ;;
      esac
    fi
    grep -E "ERROR SUMMARY|LEAK SUMMARY" "$log" | tail -n 2 | sed 's/^/    /'
  } >>"$md"
  (( rc != 0 )) && return "$rc"
  return "$src"
}

run_stage() {
  local stage=$1 t rc t0
  stage_fit "$stage" $((SECONDS - T_START))
  if [[ -n $FIT_WHY ]]; then
    set_status "$stage" "skipped" 0 "$FIT_WHY; run \`bash tools/gpu-check.sh $stage\` in another call"
    log "$stage: skipped, $FIT_WHY"
    return
  fi
  t=$FIT_T
  log "$stage: starting (timeout ${t}s)"
  t0=$SECONDS
  (
    echo "== $stage, run $RUN_ID, timeout ${t}s, $(date -u +%H:%M:%S)"
    export -f stage_cmd sanitizer_path run_sanitizer run_stress
    export PY WORK ROOT WHEEL WHEELHOUSE
    timeout -k 15 "$t" bash -c "$(declare -p PYTEST_EXTRA); stage_cmd $stage"
    rc=$?
    echo "== exit status $rc after $((SECONDS - t0))s"
    exit $rc
  ) >"$WORK/logs/$stage.log" 2>&1
  rc=$?
  local secs=$((SECONDS - t0)) result detail=""
  case $rc in
    0) result=ok ;;
    124|137) result="TIMEOUT"; detail="killed after ${t}s" ;;
    99) result="skipped"; detail=$(tail -n 2 "$WORK/logs/$stage.log" | head -n 1) ;;
    *) result="FAILED"; detail="exit status $rc" ;;
  esac
  case $stage in
    gputests|cputests|tests)
      local line
      line=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran' "$WORK/logs/$stage.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
      detail="${detail:+$detail; }$line"
      # everything skipped (no GPU seen, torch or CuPy missing) is not a pass
      [[ $result == ok && $line != *passed* ]] && result="ALL SKIPPED" ;;
    torch-versions)  # its last line: what each torch did (with 99, already the detail)
      ((rc != 99)) && detail="${detail:+$detail; }$(tail -n 2 "$WORK/logs/$stage.log" | head -n 1)" ;;
  esac
  set_status "$stage" "$result" "$secs" "$detail"
  log "$stage: $result ($secs s)"
  pack
}

for s in "${STAGES[@]}"; do
  run_stage "$s"
done
pack
log "done in $((SECONDS - T_START)) s; $OUT/summary.md"
grep -vq $'\tok\t' <(awk -F'\t' -v r="$RUN_ID" '$4 == r' "$STATUS") && exit 1
exit 0
