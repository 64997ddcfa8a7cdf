#!/usr/bin/env bash
# The GPU checks as one command, on a machine with a CUDA GPU (run from anywhere in the repo):
#
#   scripts/gpu_check.sh
#
# 1. The CUDA tests: tests/unit/backends/test_cuda.py (every method on CUDA tensors against NumPy,
#    and PyTorch's packed per-tensor TopK, DGC and random-k steps against a bucket per tensor)
#    and tests/unit/kernels/test_triton.py (every Triton kernel against the reference path, compiled,
#    on CUDA tensors; TRITON_INTERPRET is unset for this), the momentum correction's fused
#    accumulate-and-select among them (its host synchronizations counted too).
# 2. Exact top-k: the Triton kernel against torch.topk and the reference op, 25e6 and 1e8
#    elements (scripts/bench_topk.py).
# 3. The selection benchmark with kernels on and off, side by side:
#    scripts/bench_select.py --device cuda --sizes 25e6 1e8 --world-sizes 4 --kernels on off
# 4. ExDyna and MiCRO with the momentum correction (the fused Triton op), kernels on and off, over
#    the momentum floor: scripts/bench_select.py --device cuda --sizes 25e6 --world-sizes
#    --methods exdyna micro --kernels on off --momentum 0.9
# 5. The DDP face on NCCL and CUDA tensors: every method as a DDP communication hook, one rank per
#    GPU, error feedback checked on every step (scripts/workers/ddp_cuda_check.py)
#
# Logs go to bench/gpu/ (cuda_tests_<gpu>.log, topk_kernels_<gpu>.log, select_kernels_<gpu>.log,
# select_momentum_<gpu>.log, ddp_nccl_<gpu>.log; the selection benchmarks' JSON, Markdown and figure to
# bench/gpu/select/ and bench/gpu/select-momentum/), where
# scripts/report.py collects them. On a lent machine whose tool returns only what is written under
# $OUT, they go to $OUT/bench/gpu/ instead, as they are written (so a run killed at its time limit
# still returns them): copy that folder over bench/gpu/ afterwards. Each stage has a time limit
# (GPU_CHECK_TEST_SECONDS 190, GPU_CHECK_TOPK_SECONDS 45, GPU_CHECK_BENCH_SECONDS 190,
# GPU_CHECK_MOMENTUM_SECONDS 70, GPU_CHECK_DDP_SECONDS 90 by default) so that the whole run fits a 10-minute lease; a stage
# cut off keeps its log as far as it got and says so. The first use of each Triton kernel
# compiles it (seconds; cached on disk), which the tests pay, and the benchmarks' warm-up calls.
#
# Python: $PYTHON, else the repository's .venv if its torch sees a GPU, else python3. It needs a
# CUDA build of torch (which brings Triton); hvd_sparse is installed editable (--no-deps) when it
# cannot be imported with its kernels. Exit status: 0 when every stage passed.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out="${OUT:+$OUT/bench/gpu}"
out="${out:-$repo/bench/gpu}"
test_seconds=${GPU_CHECK_TEST_SECONDS:-190}
topk_seconds=${GPU_CHECK_TOPK_SECONDS:-45}
bench_seconds=${GPU_CHECK_BENCH_SECONDS:-190}
momentum_seconds=${GPU_CHECK_MOMENTUM_SECONDS:-70}
ddp_seconds=${GPU_CHECK_DDP_SECONDS:-90}

log() { printf '[gpu_check] %s\n' "$*"; }
die() { printf '[gpu_check] ERROR: %s\n' "$*" >&2; exit 2; }

sees_gpu() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ] && sees_gpu "$repo/.venv/bin/python"; then
        python="$repo/.venv/bin/python"
    else
        python=python3
    fi
fi
sees_gpu "$python" || die "$python: torch does not see a CUDA GPU (a CUDA build of torch is needed)"
"$python" -c 'import triton' 2>/dev/null || die "$python: Triton is missing (a CUDA build of torch brings it)"
if ! "$python" -c 'import hvd_sparse.kernels.triton' 2>/dev/null; then
    log "installing hvd_sparse (editable, --no-deps) so that hvd_sparse.kernels imports"
    install_log=$(mktemp)   # not under bench/gpu/, whose *.log files are results
    "$python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >"$install_log" 2>&1 \
        || "$python" -m pip install -q --no-deps -e "$repo" >>"$install_log" 2>&1 \
        || { tail -n 30 "$install_log" >&2; die "pip install -e failed (log above)"; }
    "$python" -c 'import hvd_sparse.kernels.triton' || die "hvd_sparse.kernels.triton does not import"
fi

mkdir -p "$out/select" "$out/select-momentum"
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')
tag=$(printf '%s' "$gpu" | tr 'A-Z' 'a-z' | grep -oE '[a-z][0-9]{2,4}[a-z]?' | head -n 1)
tag=${tag:-gpu}
versions=$("$python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")')
log "$gpu; $versions; python $python"

export OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3 TF_USE_LEGACY_KERAS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET HVD_SPARSE_KERNELS
status=0

# run_stage NAME LOGFILE SECONDS COMMAND...: the command's output to the terminal and the log,
# headed by the machine and the command, ended by its verdict.
run_stage() {
    local name=$1 logfile=$2 seconds=$3 rc
    shift 3
    {
        echo "# $gpu; $versions; $(date -u +%Y-%m-%dT%H:%MZ)"
        echo "# \$ $*"
    } >"$logfile"
    log "$name (at most ${seconds}s) -> ${logfile#"$repo"/}"
    timeout --signal=INT --kill-after=20 "$seconds" "$@" 2>&1 | tee -a "$logfile"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "# CUT OFF after ${seconds}s: the output above is as far as it got" | tee -a "$logfile"
    else
        echo "# exit status $rc" | tee -a "$logfile"
    fi
    [ "$rc" -eq 0 ] || status=1
}

run_stage "CUDA tests" "$out/cuda_tests_$tag.log" "$test_seconds" \
    "$python" -m pytest -q -p no:cacheprovider --timeout=180 \
    tests/unit/backends/test_cuda.py tests/unit/kernels/test_triton.py
run_stage "top-k kernel against torch.topk" "$out/topk_kernels_$tag.log" "$topk_seconds" \
    "$python" scripts/bench_topk.py --device cuda --sizes 25e6 1e8
run_stage "selection benchmark, kernels on and off" "$out/select_kernels_$tag.log" "$bench_seconds" \
    "$python" scripts/bench_select.py --device cuda --sizes 25e6 1e8 --world-sizes 4 \
    --kernels on off --out-dir "$out/select"
run_stage "momentum correction: ExDyna and MiCRO over the momentum floor" "$out/select_momentum_$tag.log" \
    "$momentum_seconds" "$python" scripts/bench_select.py --device cuda --sizes 25e6 --world-sizes \
    --methods exdyna micro --kernels on off --momentum 0.9 --repeats 5 --out-dir "$out/select-momentum"
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
run_stage "DDP hooks on NCCL and CUDA tensors, $gpus rank(s)" "$out/ddp_nccl_$tag.log" "$ddp_seconds" \
    "$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus" scripts/workers/ddp_cuda_check.py

log "done (status $status); logs in $out/"
exit "$status"
