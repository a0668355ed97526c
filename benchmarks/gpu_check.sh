#!/usr/bin/env bash
# One prepared GPU check, under 10 minutes on one GPU (H100/H200 class), writing one results file.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Steps (each with its own time limit; a step that fails or times out is recorded and the next runs):
#   1. the CUDA tests: `pytest -k cuda` (the `cuda`-marked tests and the [cuda] parametrizations) (<= 120 s)
#   2. bench_hdi_scale.py: 7B and 70B shapes, TF32 off and on                              (<= 160 s)
#   3. bench_activations.py --device cuda: covariance cost per measured step               (<= 70 s)
#   4. bench_overhead.py --accelerator gpu: training overhead of HDIMonitor                 (<= 100 s)
#   5. bench_long_run.py --device cuda --steps 600 --budget 256 --inductor: bytes, history and checkpoint
#      size, held time of image steps on the GPU; inductor on CUDA: graphs, graph breaks,
#      bit-identical weights with and without the monitor                                 (<= 150 s)
# The engine checks (tensor parallel, ZeRO-3, FSDP) run on the CPU with gloo in the tests; they are
# not repeated here.
# Results: $OUT/gpu_check.md if OUT is set, else benchmarks/results/gpu_check.md.
# Environment: PYTHON (default: python), the interpreter with hdi-monitor's dev extra and a CUDA torch.
# DRY_RUN=1 runs the same steps with CPU-sized arguments (no GPU needed), to check the script itself;
# its figures are not GPU figures.
set -u -o pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${OUT:-}" ]; then
    DEST="$OUT/gpu_check.md"
else
    DEST="benchmarks/results/gpu_check.md"
fi
mkdir -p "$(dirname "$DEST")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)

DRY="${DRY_RUN:-0}"
if [ "$DRY" = "1" ]; then
    DEV=cpu ACC=cpu SCALE="--small --tf32 off" TOKENS="1024" WIDE="--wide-tokens" ROUNDS="--rounds 1 --steps 60"
    LONG="--steps 40"
else
    DEV=cuda ACC=gpu SCALE="--tf32 both" TOKENS="1024 4096 16384" WIDE="" ROUNDS="--rounds 3 --steps 200"
    LONG="--steps 600 --budget 256 --inductor"  # both size marks (300, 600) past the history budget
fi
if [ "$DRY" != "1" ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to $PY; nothing measured" | tee "$DEST"
    exit 1
fi

{
    echo "# GPU check$([ "$DRY" = "1" ] && echo ' (DRY RUN on the CPU: not GPU figures)')"
    echo
    echo "Date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available"
    "$PY" -c 'import torch, platform; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"))'
    echo '```'
} >"$DEST"

STATUS=0
# step NAME LIMIT_SECONDS COMMAND...: run with a time limit, keep its output, record its exit status
step() {
    local name="$1" limit="$2"
    shift 2
    local t0=$(date +%s) rc
    echo "== $name (limit ${limit}s)" >&2
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - t0 ))
    [ "$rc" -ne 0 ] && STATUS=1
    {
        echo
        echo "## $name"
        echo
        echo "Command: \`$*\`; exit status $rc$( { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && echo ' (timed out)'); ${secs} s."
        if [ -s "$WORK/$name.md" ]; then
            echo
            cat "$WORK/$name.md"
        else
            echo
            echo '```'
            tail -n 40 "$WORK/$name.log"
            echo '```'
        fi
    } >>"$DEST"
}

# 1. CUDA tests: `-k cuda` selects the tests marked `cuda` (marker names are keywords) and the
#    device-parametrized ones whose id says cuda, in one collection
step cuda_tests 120 "$PY" -m pytest -q -k cuda -p no:cacheprovider tests
# 2. HDI at LLM scale, TF32 off and on, both shapes (24 GB of bf16 weights for 70B)
# shellcheck disable=SC2086
step hdi_scale 160 "$PY" benchmarks/bench_hdi_scale.py --device "$DEV" --shapes 7b 70b $SCALE --repeats 2 \
    --out "$WORK/hdi_scale.md"
# 3. head-output covariance per measured step, GPT-2-small and 4096-wide layers, 1k/4k/16k tokens
# shellcheck disable=SC2086
step activations 70 "$PY" benchmarks/bench_activations.py --device "$DEV" --tokens $TOKENS $WIDE --repeats 3 \
    --out "$WORK/activations.md"
# 4. training overhead of HDIMonitor on the GPU
# shellcheck disable=SC2086
step overhead 100 "$PY" benchmarks/bench_overhead.py --accelerator "$ACC" $ROUNDS --out "$WORK/overhead.md"
# 5. a long run through the real pipeline on the GPU, and inductor on CUDA (graphs, breaks, weights)
# shellcheck disable=SC2086
step long_run 150 "$PY" benchmarks/bench_long_run.py --device "$DEV" $LONG --out "$WORK/long_run.md"

{
    echo
    echo "Total: $(( $(date +%s) - START )) s; overall status $STATUS (0: every step passed)."
} >>"$DEST"
echo "gpu_check: results in $DEST" >&2
exit "$STATUS"
