#!/usr/bin/env bash
# A dry run of tools/gpu-check.sh on a machine without a GPU: the stages run
# against real torch (and transformers), with stand-ins for the CUDA driver,
# runtime, cuBLAS and NVML preloaded. Kernels and copies do nothing, so every
# value a test or benchmark checks is meaningless and those checks fail; what
# a dry run shows is everything else: which allocator serves what, pools and
# their stats, torch's hooks, graph pools, peak reserved bytes (the same
# requests as on a GPU), and that each stage's script runs to its report.
# It is no GPU check: nothing it prints may be reported as one.
#
#   bash tools/build-gpu-wheel.sh                       # the wheel, as for the device
#   PYTHON=/path/to/python3.12-with-torch bash tools/gpu-dryrun.sh gputests gpt2
#
# Arguments are gpu-check.sh's stages or groups (default: gputests gpt2). The
# stand-ins are built from tests/csrc/fake_cuda.c (libcuda.so.1),
# tests/csrc/fake_cudart.c, tests/csrc/fake_cublas.c and
# gocore/nvmldev/testdata/fake_nvml.c into $GMP_DRYRUN_DIR (default
# /tmp/gmp-dryrun), with the logs and results under $GMP_DRYRUN_DIR/work
# and summary.md in $GMP_DRYRUN_DIR/out. Not covered: NCCL (it needs a real
# driver), CuPy's kernels, compute-sanitizer, and torch builds other than
# CUDA 13's (the device properties follow CUDA 13's layout).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GMP_DRYRUN_DIR:-/tmp/gmp-dryrun}
CC=${CC:-cc}
mkdir -p "$DIR/lib" "$DIR/out" "$DIR/work"
"$CC" -O1 -shared -fPIC -pthread -o "$DIR/lib/libcuda.so.1" tests/csrc/fake_cuda.c -ldl
"$CC" -O1 -shared -fPIC -o "$DIR/lib/libnvidia-ml.so.1" gocore/nvmldev/testdata/fake_nvml.c
"$CC" -O1 -shared -fPIC -o "$DIR/fake_cudart.so" tests/csrc/fake_cudart.c -ldl
"$CC" -O1 -shared -fPIC -o "$DIR/fake_cublas.so" tests/csrc/fake_cublas.c
[[ $# -eq 0 ]] && set -- gputests gpt2
echo "gpu-dryrun: stand-in CUDA in $DIR; kernels do nothing, so value checks fail by design" >&2
export OUT="$DIR/out" GMP_WORK="$DIR/work" GMP_VENV="${GMP_VENV:-$DIR/venv}"
export FAKE_CUDA_DEVICES=1 FAKE_CUDA_CAPACITY=$((80 << 30))
export LD_LIBRARY_PATH="$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_PRELOAD="$DIR/fake_cudart.so:$DIR/fake_cublas.so${LD_PRELOAD:+:$LD_PRELOAD}"
export GMP_CHECK_DEADLINE=${GMP_CHECK_DEADLINE:-3000}
exec bash tools/gpu-check.sh "$@"
