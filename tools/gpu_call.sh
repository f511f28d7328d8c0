#!/usr/bin/env bash
# One device call of docs/GPU_RUNBOOK.md, sized for a lease of 15 minutes: every phase runs
# under its own `timeout` inside a deadline of $2 seconds, most valuable first, and writes
# under $OUT as it goes, so a phase that runs long costs only the phases after it.
#
#   bash tools/gpu_call.sh compile [SECONDS]       # issues 34 and 35 (default 530 s): compile
#                                                  # check, the compiled levels incl. row/block,
#                                                  # optimizer, FP8 GEMMs, CUDA kernel tests
#   bash tools/gpu_call.sh compile-rest [SECONDS]  # right after it, on the warm machine: the
#                                                  # rows and optimizer levels it did not reach
#   bash tools/gpu_call.sh rowblock [SECONDS]      # issue 35 (a third call, or a later lease):
#                                                  # kernel tests, row/block rows, cast unit
#   bash tools/gpu_call.sh measure [SECONDS]       # versions, FP8 linear, GPT 1.3B levels, tests
#   bash tools/gpu_call.sh max-size [SECONDS]      # largest GPT at bf16 and O2
#
# The device tool's `run` calls it with `carry: [".whl"]` (tools/fetch_gpu_wheels.sh).
# At most 8 files come back from $OUT: compile, compile-rest and rowblock keep their raw files
# (one log and JSON per process) in $WORK, which a warm machine keeps between calls, and pack
# them into $OUT/raw.tar.gz at the end.
set -u
phase=${1:?compile, compile-rest, rowblock, measure or max-size}
case $phase in
compile) deadline=${2:-530} ;;
compile-rest) deadline=${2:-240} ;;
*) deadline=${2:-540} ;;
esac
OUT=${OUT:-/tmp/gpu_out}
WORK=${GPU_CALL_WORK:-/tmp/gpu_call_work} # another folder: a dry run (tests/test_gpu_call.py)
mkdir -p "$OUT" "$WORK"
start=$(date +%s)
left() { echo $((deadline - ($(date +%s) - start))); }
# A phase's timeout: what it asks for, but never past the deadline less a margin for the rest.
budget() { local want=$1 margin=${2:-10} have; have=$(($(left) - margin)); echo $((want < have ? want : have)); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
log() { echo "[gpu_call $(($(date +%s) - start)) s] $*" | tee -a "$OUT/calls.log"; }
# without "LIST" TOKEN...: the row tokens of LIST less the TOKENs, one space apart. (Row
# tokens and shapes hold no spaces or glob characters: a list of them is a string of words.)
without() {
    local list=" $1 " t words
    shift
    for t in "$@"; do list=${list// "$t" / }; done
    read -ra words <<<"$list"
    echo "${words[*]}"
}

# ------------------------------------------------------------ compile, compile-rest, rowblock
# GPT-1.3B rows, most valuable first: the compiled rows that decide issue 34 (FP8 against
# bf16, compiled against compiled) and issue 35 (row and block against per-tensor: te:bf16@row
# and @block against te:bf16, O3:bf16@block against O3:bf16), whose eager and earlier
# measurements exist (2026-11-28: BENCHMARKS.md); then PyTorch's compiled step, O2 at block,
# the eager rows, torchao's compiled float8 (its compile alone took ~110 s: not started with
# under 150 s left), O1 (no target), PyTorch eager. `compile` is expected to reach about
# ROWS_FIRST, `compile-rest` about the first four of ROWS_LATER.
ROWS_FIRST="bf16+compile te:bf16+compile te:bf16@row+compile te:bf16@block+compile"
ROWS_FIRST+=" O2:bf16+compile"
ROWS_LATER="O3:bf16+compile O3:bf16@block+compile plain+compile O2:bf16@block+compile bf16"
ROWS_LATER+=" te:bf16 O2:bf16 O3:bf16 torchao-tensorwise+compile O1:bf16+compile O1:bf16 plain"
ROWS="$ROWS_FIRST $ROWS_LATER"
# rowblock's rows: issue 35's compiled rows with their per-tensor references, then its eager
# rows (the compile's gain at row and block).
ROWBLOCK_ROWS="te:bf16+compile te:bf16@row+compile te:bf16@block+compile O3:bf16+compile"
ROWBLOCK_ROWS+=" O3:bf16@block+compile O2:bf16@block+compile te:bf16@row te:bf16@block"
# The compile check's levels (2 layers, all at once): the compiled rows above, except O1
# (last in ROWS) and O2@block (its layer compiles cold in its 1.3B row, late in the list).
CHECK_LEVELS="bf16 te:bf16 O2:bf16 O3:bf16 te:bf16@row te:bf16@block O3:bf16@block"
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
    # Whether a linear binds cuBLASLt's block-scaled GEMM here (the probe against the
    # emulation; fp8train's own line says which path and why). Without it a 1.3B block row
    # would time the emulation (4395 ms a step on 2026-11-28): those rows are dropped.
    timeout 60 python3 -c 'from fp8train import block_scaled_mm, device
print("BLOCK_KERNEL", int(device.is_cuda() and block_scaled_mm.bind("cuda") is not None))' \
        >"$WORK/block_kernel.txt" 2>&1
    tee -a "$OUT/calls.log" <"$WORK/block_kernel.txt"
}

# The 1.3B rows not to run in this call: the compiled rows whose check failed (compile's
# $WORK/dropped, which later calls on the machine honour) and, without the block-scaled
# kernel, the block rows.
drops() {
    local d=""
    [ -f "$WORK/dropped" ] && d=$(cat "$WORK/dropped")
    if grep -q "^BLOCK_KERNEL 0" "$WORK/block_kernel.txt" 2>/dev/null; then
        d+=" $(echo " $ROWS $ROWBLOCK_ROWS " | tr ' ' '\n' | grep @block | sort -u | tr '\n' ' ')"
    fi
    without "$d"
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

# kernel_tests WANT MARGIN LEAST: issue 35's CUDA-only tests (skipped on the CPU; `-k cuda`
# selects them and one cheap CPU test): the Triton cast kernels bit for bit against the torch
# cast, eager and compiled (tests/test_triton_cast.py), cuBLASLt's block-scaled and row-wise
# GEMMs and a linear on them against the emulation (tests/test_block_scaled_mm.py). Under
# `budget WANT MARGIN`, not started with under LEAST s; once they ran to the end, not again.
kernel_tests() {
    local t
    t=$(budget "$1" "$2")
    if [ -f "$WORK/kernel_tests_done" ]; then
        log "kernel tests: ran in an earlier call on this machine"
        return
    elif [ "$t" -lt "$3" ]; then
        log "kernel tests: skipped (${t} s left)"
        return
    fi
    log "kernel tests (timeout ${t} s)"
    timeout "$t" python3 -m pytest -p no:cacheprovider -n 4 --timeout $((t - 10)) -rfE -v \
        -k cuda tests/test_triton_cast.py tests/test_block_scaled_mm.py >"$OUT/kernel_tests.log" 2>&1
    local rc=$?
    log "kernel tests rc=$rc: $(tail -n 1 "$OUT/kernel_tests.log")"
    [ "$rc" -le 1 ] && touch "$WORK/kernel_tests_done" # 0 passed, 1 failures: it ran through
}

# levels NAME LIMIT ROW...: the 1.3B rows, under a --time-limit; JSON and log as $OUT/NAME.*
# and a copy of the JSON in $WORK (the next call on this machine reads it).
levels() {
    local name=$1 limit=$2
    shift 2
    log "levels 1.3b ${bod[*]} (time limit ${limit} s): $*"
    [ $# -gt 0 ] || return
    timeout $((limit + 30)) python3 -m benchmarks.bench_gpu levels "${LEVELS_ARGS[@]}" "${bod[@]}" \
        --time-limit "$limit" --json "$OUT/$name.json" --rows "$@" >"$OUT/$name.log" 2>&1
    log "levels rc=$?"
    cp "$OUT/$name.json" "$WORK/$name.json" 2>/dev/null
}

if [ "$phase" = compile ]; then
    rm -rf "${WORK:?}"/* && env_lines
    trap pack EXIT
    # 1. Does a compiled layer run on CUDA at all, at each granularity? Each level's compiled
    # row at the 1.3B width with 2 layers (the same layer graph as 24: its compiled kernels
    # warm the on-disk inductor and Triton caches for the 1.3B rows), plus one eager row built
    # on the device; all at once, two compile workers each (eight processes, 16 cores).
    t=$(budget 150 330)
    log "check: compiled layers on CUDA, 1.3B width, 2 layers, 7 levels at once (timeout ${t} s)"
    check=(--size 1.3b --layers 2 --warmup 2 --steps 1 --profile-steps 1 --in-process
        --build-on-device)
    for lv in $CHECK_LEVELS; do
        f=check_${lv//:/_}
        TORCHINDUCTOR_COMPILE_THREADS=2 timeout "$t" python3 -m benchmarks.bench_gpu levels \
            "${check[@]}" --rows "$lv+compile" --json "$WORK/$f.json" >"$WORK/$f.log" 2>&1 &
    done
    timeout "$t" python3 -m benchmarks.bench_gpu levels "${check[@]}" --rows bf16 \
        --json "$WORK/check_eager.json" >"$WORK/check_eager.log" 2>&1 &
    wait
    python3 -m benchmarks.gpu_call_plan check "$WORK"/check_*.json >"$WORK/check.txt" 2>&1
    tee -a "$OUT/calls.log" <"$WORK/check.txt" # a failed row's traceback: raw.tar.gz
    sed -n 's/^DROP //p' "$WORK/check.txt" | tr '\n' ' ' >"$WORK/dropped"
    bod=()
    grep -q "^BUILD_ON_DEVICE 1" "$WORK/check.txt" && bod=(--build-on-device)
    echo "${bod[*]}" >"$WORK/build_on_device"
    read -ra drop <<<"$(drops)"
    [ ${#drop[@]} -gt 0 ] && log "not run in this call or the next: ${drop[*]}"
    # 2. The levels table, with what is left after the share of the optimizer, the GEMMs and
    # the kernel tests (190 s).
    read -ra rows <<<"$(without "$ROWS" "${drop[@]}")"
    levels levels $(($(left) - 190)) "${rows[@]}"
    cp "$WORK/levels.json" "$WORK/levels_call1.json" 2>/dev/null
    # 3. LowBitAdamW against torch's fused AdamW at O2 (measured at 130 against 29 ms), issue
    # 35's GEMM micro-benchmark at the step's shapes (per tensor, row, block; seconds), its
    # kernel tests, then O3 and O1 with what is left.
    optimizer O2 95
    log "fp8 gemm"
    read -ra shapes <<<"$GEMM_SHAPES"
    timeout "$(budget 60 50)" python3 -m benchmarks.bench_fp8_gemm --reps 10 --shapes "${shapes[@]}" \
        >"$OUT/gemm.log" 2>&1
    log "fp8 gemm rc=$?: $(grep '^block kernel:' "$OUT/gemm.log")"
    kernel_tests 120 5 40
    optimizer O3 5
    optimizer O1 5
elif [ "$phase" = compile-rest ]; then
    # What `compile` did not reach, on the machine it ran on (its $WORK is still there); on a
    # fresh machine the reference rows run again first, so that the ratios stay in one call.
    env_lines
    trap pack EXIT
    read -ra all <<<"$ROWS"
    if [ -f "$WORK/levels_call1.json" ]; then
        todo=$(python3 -m benchmarks.gpu_call_plan rest "$WORK/levels_call1.json" "${all[@]}")
        read -ra bod <"$WORK/build_on_device"
    else
        log "no earlier call on this machine: the references, then the later rows"
        todo="bf16+compile $ROWS_LATER"
        bod=(--build-on-device)
    fi
    read -ra drop <<<"$(drops)"
    read -ra rows <<<"$(without "$todo" "${drop[@]}")"
    levels levels_rest $(($(left) - 60)) "${rows[@]}"
    cp "$WORK/levels_rest.json" "$WORK/levels_call2.json" 2>/dev/null
    if [ -f "$WORK/levels_call1.json" ] && [ -f "$OUT/levels_rest.json" ]; then
        python3 -m benchmarks.bench_gpu report --merge "$WORK/levels_call1.json" \
            "$OUT/levels_rest.json" >"$OUT/levels_merged.md" 2>&1
    fi
    kernel_tests 120 5 40
    for lv in O2 O3 O1; do
        grep -qx "$lv" "$WORK/optimizer_done" 2>/dev/null || optimizer "$lv" 5
    done
elif [ "$phase" = rowblock ]; then
    # Issue 35 after `compile` (and `compile-rest`) on the same machine, or on a fresh one:
    # the kernel tests unless they ran, the row/block rows not yet measured (on a fresh machine
    # with their per-tensor references), then the cast unit (Triton against the torch cast,
    # eager and compiled: ~300 s with its compiles; it prints each row as it goes).
    env_lines
    trap pack EXIT
    kernel_tests 150 200 40
    runs=("$WORK"/levels_call*.json)
    read -ra all <<<"$ROWBLOCK_ROWS"
    if [ -f "${runs[0]}" ]; then
        todo=$(python3 -m benchmarks.gpu_call_plan rest "${runs[@]}" "${all[@]}")
        read -ra bod <"$WORK/build_on_device"
    else
        todo=$ROWBLOCK_ROWS
        bod=(--build-on-device)
    fi
    read -ra drop <<<"$(drops)"
    read -ra rows <<<"$(without "$todo" "${drop[@]}")"
    levels levels_rowblock $(($(left) - 150)) "${rows[@]}"
    if [ -f "${runs[0]}" ] && [ -f "$OUT/levels_rowblock.json" ]; then
        python3 -m benchmarks.bench_gpu report --merge "${runs[@]}" "$OUT/levels_rowblock.json" \
            >"$OUT/levels_merged.md" 2>&1
    fi
    log "cast unit"
    timeout "$(budget 300 5)" python3 -m benchmarks.bench_cast --reps 50 >"$OUT/cast.log" 2>&1
    log "cast unit rc=$?"
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
compile | compile-rest | rowblock) ;;
*) tail -n 30 "$OUT"/*.log ;;
esac
