#!/usr/bin/env bash
# One device call of docs/GPU_RUNBOOK.md, sized for a lease of 15 minutes: every phase runs
# under its own `timeout` inside a deadline of $1 seconds (default 540), most valuable first,
# and writes under $OUT as it goes, so a phase that runs long costs only the phases after it.
#
#   bash tools/gpu_call.sh measure [SECONDS]   # versions, FP8 linear, GPT 1.3B levels, tests
#   bash tools/gpu_call.sh fused [SECONDS]     # fused FP8 casts against eager, 1.3B te:bf16
#   bash tools/gpu_call.sh max-size [SECONDS]  # largest GPT at bf16 and O2
#
# The device tool's `run` calls it with `carry: [".whl"]` (tools/fetch_gpu_wheels.sh).
set -u
phase=${1:?measure or max-size}
deadline=${2:-540}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $((deadline - ($(date +%s) - start))); }
# A phase's timeout: what it asks for, but never past the deadline less a margin for the rest.
budget() { local want=$1 margin=${2:-10} have; have=$(($(left) - margin)); echo $((want < have ? want : have)); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
log() { echo "[gpu_call $(($(date +%s) - start)) s] $*" | tee -a "$OUT/calls.log"; }

if [ "$phase" = measure ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/env.txt"
    python3 -c 'import torch, importlib.metadata as m; print(torch.__version__, torch.version.cuda,
        torch.cuda.get_device_name(), m.version("torchao"), m.version("megatron-core"))' \
        >>"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    log "linear"
    timeout "$(budget 80 400)" python3 tools/bench_gpu.py linear --json "$OUT/linear.json" \
        >"$OUT/linear.log" 2>&1
    log "linear rc=$?"
    log "levels 1.3b"
    timeout "$(budget 330 70)" python3 tools/bench_gpu.py levels --size 1.3b --steps 5 \
        --warmup 2 --row-timeout 70 --profile --json "$OUT/levels_1.3b.json" \
        --levels bf16 te O2 O3 te:bf16 O2:bf16 --baselines plain torchao-tensorwise \
        torchao-rowwise >"$OUT/levels_1.3b.log" 2>&1
    log "levels rc=$?"
    # Single-process tests on the GPU (torch 2.11, Python 3.12, CUDA) with what time is left.
    log "tests"
    timeout "$(budget 300 5)" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
        tests/test_fp8_gemm.py tests/test_fp8_linear.py tests/test_lowbit_adam.py \
        tests/test_train_resume.py tests/test_grad_buffers.py tests/test_precision.py \
        tests/test_initialize.py tests/test_recompute.py tests/test_gpt_model.py \
        tests/test_bench_gpu.py >"$OUT/tests.log" 2>&1
    log "tests rc=$?"
elif [ "$phase" = fused ]; then
    # The fused FP8 casts (fp8train/fused_casts.py) side by side with the eager ones.
    for fused in 0 1; do
        log "linear fused=$fused"
        FP8TRAIN_FUSED_CASTS=$fused timeout "$(budget 45 150)" python3 tools/bench_gpu.py linear \
            --json "$OUT/linear_fused$fused.json" >"$OUT/linear_fused$fused.log" 2>&1
    done
    log "levels te:bf16 fused, profiled"
    timeout "$(budget 80 75)" python3 tools/bench_gpu.py levels --size 1.3b --steps 5 --warmup 2 \
        --profile --levels te:bf16 --baselines --json "$OUT/levels_tebf16.json" \
        >"$OUT/levels_tebf16.log" 2>&1
    log "levels bf16, O2:bf16 fused"
    timeout "$(budget 200 3)" python3 tools/bench_gpu.py levels --size 1.3b --steps 5 --warmup 2 \
        --levels bf16 O2:bf16 --baselines --json "$OUT/levels_ref.json" >"$OUT/levels_ref.log" 2>&1
    log "done"
elif [ "$phase" = max-size ]; then
    log "max-size"
    # Built on the GPU (host initialisation of a 10B model takes minutes per attempt); bf16
    # and O2 (the precision table's memory claim), each with half of what is left.
    timeout "$(budget 600 5)" python3 tools/bench_gpu.py max-size --build-on-device \
        --levels bf16 O2 --start-layers 48 --tolerance 0.25 --budget-s $(($(left) / 2 - 15)) \
        --row-timeout 60 --json "$OUT/max_size.json" >"$OUT/max_size.log" 2>&1
    log "max-size rc=$?"
fi
tail -n 30 "$OUT"/*.log
