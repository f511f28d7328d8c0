#!/usr/bin/env bash
# One device call of docs/GPU_RUNBOOK.md, sized for a lease of 15 minutes: every phase runs
# under its own `timeout` inside a deadline of $2 seconds, most valuable first, and writes
# under $OUT as it goes, so a phase that runs long costs only the phases after it.
#
#   bash tools/gpu_call.sh compile [SECONDS]       # issue 34 item 9 (default 530 s): compile
#                                                  # check, levels eager + compiled, optimizer,
#                                                  # FP8 GEMMs
#   bash tools/gpu_call.sh compile-rest [SECONDS]  # right after it, on the warm machine: the
#                                                  # rows and optimizer levels it did not reach
#   bash tools/gpu_call.sh measure [SECONDS]       # versions, FP8 linear, GPT 1.3B levels, tests
#   bash tools/gpu_call.sh max-size [SECONDS]      # largest GPT at bf16 and O2
#
# The device tool's `run` calls it with `carry: [".whl"]` (tools/fetch_gpu_wheels.sh).
# At most 8 files come back from $OUT: compile and compile-rest keep their raw files (one log
# and JSON per process) in $WORK, which a warm machine keeps between calls, and pack them
# into $OUT/raw.tar.gz at the end.
set -u
phase=${1:?compile, compile-rest, measure or max-size}
case $phase in
compile) deadline=${2:-530} ;;
compile-rest) deadline=${2:-240} ;;
*) deadline=${2:-540} ;;
esac
OUT=${OUT:-/tmp/gpu_out}
WORK=/tmp/gpu_call_work
mkdir -p "$OUT" "$WORK"
start=$(date +%s)
left() { echo $((deadline - ($(date +%s) - start))); }
# A phase's timeout: what it asks for, but never past the deadline less a margin for the rest.
budget() { local want=$1 margin=${2:-10} have; have=$(($(left) - margin)); echo $((want < have ? want : have)); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
log() { echo "[gpu_call $(($(date +%s) - start)) s] $*" | tee -a "$OUT/calls.log"; }

# ----------------------------------------------------------------------- compile, compile-rest
# GPT-1.3B levels of issue 34, most valuable first: the compiled pair that decides the issue,
# its eager pair, PyTorch's compiled step, then O2 and O3 (targets), torchao's compiled float8
# (its compile alone took ~110 s: not started with under 150 s left), O1 (no target), PyTorch
# eager (measured twice already).
CHECK_LEVELS="bf16 te:bf16 O2:bf16 O3:bf16 O1:bf16"
ROWS="bf16+compile te:bf16+compile bf16 te:bf16 plain+compile O2:bf16+compile O2:bf16"
ROWS+=" O3:bf16+compile O3:bf16 torchao-tensorwise+compile O1:bf16+compile O1:bf16 plain"
# The step's GEMMs at micro-batch 4 x 2048 tokens, hidden 2048 (M x K x N): QKV, attention
# output, FC1, FC2.
GEMM_SHAPES="8192x2048x6144 8192x2048x2048 8192x2048x8192 8192x8192x2048"
LEVELS_ARGS=(--size 1.3b --warmup 3 --steps 6 --profile --profile-steps 2 --row-timeout 90
    --compile-row-timeout 200 --torchao-compile-timeout 200)

pack() {
    tar czf "$OUT/raw.tar.gz" -C "$WORK" . 2>/dev/null
    for f in "$OUT"/levels*.json; do
        [ -f "$f" ] && python3 -m benchmarks.bench_gpu report "$f" >>"$OUT/calls.log" 2>&1
    done
    log "done"
}

env_lines() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
        >>"$OUT/calls.log" 2>&1
    # Versions, and issue 35's first question: does this torch have F.scaled_mm with block
    # scales (ScalingType.BlockWise1x128 / BlockWise128x128)?
    python3 -c 'import torch, importlib.metadata as m, torch.nn.functional as F
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "torchao", m.version("torchao"), "megatron-core", m.version("megatron-core"))
t = getattr(F, "ScalingType", None)
print("F.scaled_mm:", hasattr(F, "scaled_mm"), "ScalingType:", t and list(t.__members__))' \
        >>"$OUT/calls.log" 2>&1
}

# Optimizer rows (benchmarks/bench_optimizer.py: LowBitAdamW reference and fused against torch's
# fused AdamW, the 1.3B parameters), one level per process so that a timeout loses only it.
optimizer() {
    local lv=$1 t
    t=$(budget 110 "$2")
    if [ "$t" -lt 40 ]; then
        log "optimizer $lv: skipped (${t} s left)"
        return
    fi
    log "optimizer $lv (timeout ${t} s)"
    if timeout "$t" python3 -m benchmarks.bench_optimizer --levels "$lv" --warmup 3 --steps 10 \
        >>"$OUT/optimizer.log" 2>&1; then
        echo "$lv" >>"$WORK/optimizer_done"
        log "optimizer $lv done"
    else
        log "optimizer $lv rc=$?"
    fi
}

if [ "$phase" = compile ]; then
    rm -rf "${WORK:?}"/* && env_lines
    trap pack EXIT
    # 1. Does a compiled layer run on CUDA at all? Each level's compiled row at the 1.3B width
    # with 2 layers (the same layer graph as 24: its compiled kernels warm the on-disk inductor
    # and Triton caches for the 1.3B rows), plus one eager row built on the device; all at
    # once, fewer compile workers each.
    t=$(budget 150 330)
    log "check: compiled layers on CUDA, 1.3B width, 2 layers, 5 levels at once (timeout ${t} s)"
    check=(--size 1.3b --layers 2 --warmup 2 --steps 1 --profile-steps 1 --in-process
        --build-on-device)
    for lv in $CHECK_LEVELS; do
        f=check_${lv//:/_}
        TORCHINDUCTOR_COMPILE_THREADS=4 timeout "$t" python3 -m benchmarks.bench_gpu levels \
            "${check[@]}" --rows "$lv+compile" --json "$WORK/$f.json" >"$WORK/$f.log" 2>&1 &
    done
    timeout "$t" python3 -m benchmarks.bench_gpu levels "${check[@]}" --rows bf16 \
        --json "$WORK/check_eager.json" >"$WORK/check_eager.log" 2>&1 &
    wait
    python3 -m benchmarks.gpu_call_plan check "$WORK"/check_*.json >"$WORK/check.txt" 2>&1
    tee -a "$OUT/calls.log" <"$WORK/check.txt" # a failed row's traceback: raw.tar.gz
    rows=$ROWS
    for drop in $(sed -n 's/^DROP //p' "$WORK/check.txt"); do
        rows=$(echo " $rows " | sed "s/ $drop / /")
    done
    bod=()
    grep -q "^BUILD_ON_DEVICE 1" "$WORK/check.txt" && bod=(--build-on-device)
    # 2. The levels table, eager and compiled, with what is left after the optimizer's and
    # the GEMMs' share (150 s).
    limit=$(($(left) - 150))
    log "levels 1.3b ${bod[*]} (time limit ${limit} s): $(echo $rows)"
    timeout $((limit + 30)) python3 -m benchmarks.bench_gpu levels "${LEVELS_ARGS[@]}" "${bod[@]}" \
        --time-limit "$limit" --json "$OUT/levels.json" --rows $rows >"$OUT/levels.log" 2>&1
    log "levels rc=$?"
    cp "$OUT/levels.json" "$WORK/levels_call1.json" 2>/dev/null
    echo "${bod[*]}" >"$WORK/build_on_device"
    # 3. LowBitAdamW against torch's fused AdamW at O2 (measured at 130 against 29 ms), then
    # issue 35's GEMM micro-benchmark at the step's shapes, then O3 and O1 with what is left.
    optimizer O2 45
    log "fp8 gemm"
    timeout "$(budget 45 5)" python3 -m benchmarks.bench_fp8_gemm --reps 10 --shapes $GEMM_SHAPES \
        >"$OUT/gemm.log" 2>&1
    log "fp8 gemm rc=$?"
    optimizer O3 5
    optimizer O1 5
elif [ "$phase" = compile-rest ]; then
    # What `compile` did not reach, on the machine it ran on (its $WORK is still there); on a
    # fresh machine the reference rows run again first, so that the ratios stay in one call.
    env_lines
    trap pack EXIT
    if [ -f "$WORK/levels_call1.json" ]; then
        rows=$(python3 -m benchmarks.gpu_call_plan rest "$WORK/levels_call1.json" $ROWS)
        read -ra bod <"$WORK/build_on_device"
    else
        log "no earlier call on this machine: the references, then the rows after O2"
        rows="bf16+compile bf16 ${ROWS#*O2:bf16+compile O2:bf16}"
        bod=(--build-on-device)
    fi
    limit=$(($(left) - 60))
    log "levels 1.3b, the rest ${bod[*]} (time limit ${limit} s): $rows"
    if [ -n "$rows" ]; then
        timeout $((limit + 30)) python3 -m benchmarks.bench_gpu levels "${LEVELS_ARGS[@]}" \
            "${bod[@]}" --time-limit "$limit" --json "$OUT/levels_rest.json" --rows $rows \
            >"$OUT/levels_rest.log" 2>&1
        log "levels rc=$?"
        if [ -f "$WORK/levels_call1.json" ]; then
            python3 -m benchmarks.bench_gpu report --merge "$WORK/levels_call1.json" \
                "$OUT/levels_rest.json" >"$OUT/levels_merged.md" 2>&1
        fi
    fi
    for lv in O2 O3 O1; do
        grep -qx "$lv" "$WORK/optimizer_done" 2>/dev/null || optimizer "$lv" 5
    done
fi

if [ "$phase" = measure ]; then
    env_lines
    cat "$OUT/calls.log"
    log "linear"
    timeout "$(budget 80 400)" python3 -m benchmarks.bench_gpu linear --json "$OUT/linear.json" \
        >"$OUT/linear.log" 2>&1
    log "linear rc=$?"
    log "levels 1.3b"
    timeout "$(budget 330 70)" python3 -m benchmarks.bench_gpu levels --size 1.3b --steps 5 \
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
elif [ "$phase" = max-size ]; then
    log "max-size"
    # Built on the GPU (host initialisation of a 10B model takes minutes per attempt); bf16
    # and O2 (the precision table's memory claim), each with half of what is left.
    timeout "$(budget 600 5)" python3 -m benchmarks.bench_gpu max-size --build-on-device \
        --levels bf16 O2 --start-layers 48 --tolerance 0.25 --budget-s $(($(left) / 2 - 15)) \
        --row-timeout 60 --json "$OUT/max_size.json" >"$OUT/max_size.log" 2>&1
    log "max-size rc=$?"
fi
case $phase in
compile | compile-rest) ;;
*) tail -n 30 "$OUT"/*.log ;;
esac
