#!/usr/bin/env bash
# lowdiff on a GPU in one command (issue 35): on a bare machine with one NVIDIA GPU (H100/H200) and this repository
# copied to it, install what is missing, run the guards, the overhead benchmark and the GPU tests, write the page.
#
#   bash bench/gpu.sh [WHEEL_DIR]        # WHEEL_DIR: wheels to install from, offline (pip --no-index); without
#                                        # it, pip asks its registry for what is missing
#   bash bench/gpu.sh --dry-run          # (or LOWDIFF_GPU_DRYRUN=1) the same steps at tiny sizes on the CPU
#
# Parts, each under its own time limit (about 6 minutes where torch is there, 10 at the limits; the figures come
# before the longest tests, so that a run cut short by the lease still brings the page back):
#   1. install  (120 s)  torch and lowdiff's dependencies, only if `import` fails; lowdiff itself from this tree
#                        (PYTHONPATH, nothing installed)
#   2. guards    (90 s)  tests/integration/test_step_guards.py on the GPU (LOWDIFF_GUARD_DEVICE=cuda): no device
#                        synchronization (a TorchDispatchMode, and torch.cuda.set_sync_debug_mode("error") around
#                        lowdiff's own calls in opt.step(), the inner optimizer's step left out), no waits for copies,
#                        constant Python work per step (18 tests took 43-54 s on an H200; 22 since 2026-11-30)
#   3. overhead (240 s)  bench/overhead.py --device cuda --model-size 50m: GPT 49.6M, Top-k and PowerSGD with
#                        log.persistence thread and process, none with the thread (198 MB logged a step), each
#                        against the same compressor with enabled: false, in interleaved windows; writes
#                        OUT/overhead-gpu.{json,md}. Warm-up and setup took 94 s on an H200 with none twice (its
#                        writer at 470-500 MB/s, before cd1c022), a round 15 s
#   4. gpu tests (150 s) tests/integration/test_gpu.py (exact recovery on the GPU, kills, AMP): 13 of its 14 tests
#                        took 86 s on an H200
# Everything lands in OUT (LOWDIFF_GPU_OUT, default bench/results/gpu): gpu.log, the pytest logs, the page. A part
# that fails or runs out of time is reported and the next one runs; the exit status is that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=${LOWDIFF_GPU_DRYRUN:-0}
WHEELS=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) WHEELS=$arg ;;
    esac
done
OUT=${LOWDIFF_GPU_OUT:-$ROOT/bench/results/gpu}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: > "$LOG"
PY=${PYTHON:-python3}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
STATUS=0
T0=$(date +%s)

say() { echo "[gpu.sh +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
part() {  # part NAME SECONDS COMMAND...: run under a time limit, log it, remember the first failure
    local name=$1 limit=$2 rc
    shift 2
    say "$name: start (limit ${limit}s): $*"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        say "$name: OUT OF TIME after ${limit}s"
    else
        say "$name: exit status $rc"
    fi
    if [ $rc -ne 0 ] && [ $STATUS -eq 0 ]; then STATUS=$rc; fi
    return 0
}

if [ "$DRY" = 1 ]; then
    say "dry run: tiny sizes on the CPU"
    DEVICE=cpu
else
    DEVICE=cuda
fi

# 1. install -------------------------------------------------------------------------------------------------------
NEEDED="torch numpy h5py zstandard lz4 PyYAML tqdm isal pytest hypothesis"
if "$PY" -c "import torch, numpy, h5py, zstandard, lz4, yaml, tqdm, pytest, hypothesis" 2>/dev/null; then
    say "install: everything imports already"
elif [ "$DRY" = 1 ]; then
    say "install: would install: $NEEDED"
elif [ -n "$WHEELS" ]; then
    part install 120 "$PY" -m pip install --no-index --find-links "$WHEELS" $NEEDED
else
    part install 120 "$PY" -m pip install $NEEDED
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, lowdiff
print("torch", torch.__version__, "cuda", torch.version.cuda, "lowdiff", lowdiff.__version__, lowdiff.__file__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", "count", torch.cuda.device_count())
else:
    print("device: none (CPU only)")
EOF
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "no GPU visible to torch: stopping (bash bench/gpu.sh --dry-run runs on the CPU)"
    exit 2
fi

# 2. the guards on the device --------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then  # Top-k's alone: CI runs them all on the CPU
    LOWDIFF_GUARD_DEVICE=cpu part guards 120 "$PY" -m pytest -q -p no:cacheprovider \
        tests/integration/test_step_guards.py -k topk --junitxml="$OUT/guards.xml"
else
    LOWDIFF_GUARD_DEVICE=cuda part guards 90 "$PY" -m pytest -q -p no:cacheprovider \
        tests/integration/test_step_guards.py --junitxml="$OUT/guards.xml"
fi

# 3. the overhead benchmark ----------------------------------------------------------------------------------------
MODES=lowdiff-topk,lowdiff-topk-process,lowdiff-powersgd,lowdiff-powersgd-process,lowdiff-none
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lowdiff-gpu.XXXXXX")
if [ "$DRY" = 1 ]; then
    part overhead 120 "$PY" bench/overhead.py --smoke --device cpu --modes "$MODES" --no-memory --tidy \
        --out-dir "$OUT" --out-name overhead-gpu --work-dir "$WORK"
else
    # 6 rounds of interleaved windows (10 lowdiff steps, 5 plain), snapshots every 50 steps, the disk's bandwidth
    # measured after; --tidy keeps the disk use to one snapshot per mode. Segments of 10 steps for Top-k and
    # PowerSGD (the window's length, the most it allows): the tuner picked 55 for Top-k on an H100; the H200 run of
    # 2026-11-29 used the benchmark's default of 2, each segment's fsync and commit then paid every other step.
    part overhead 240 "$PY" bench/overhead.py --device cuda --model-size 50m --modes "$MODES" --rounds 6 \
        --batch-steps 10 --no-memory --tidy --bw-reps 3 --out-dir "$OUT" --out-name overhead-gpu --work-dir "$WORK"
fi
rm -rf "$WORK"

# 4. the GPU tests (skipped on the CPU) ------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    part gpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_gpu.py --collect-only
else
    part gpu-tests 150 "$PY" -m pytest -q -p no:cacheprovider -x tests/integration/test_gpu.py \
        --junitxml="$OUT/gpu-tests.xml"
fi

say "done in $(( $(date +%s) - T0 ))s, status $STATUS; page: $OUT/overhead-gpu.md, log: $LOG"
exit $STATUS
