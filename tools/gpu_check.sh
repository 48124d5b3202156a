#!/usr/bin/env bash
# The GPU checks of issue 17, as one prepared run on a machine with one CUDA GPU and PyTorch
# but without megatron-core, this package or a network:
#
#   1. a venv under /tmp over the machine's Python (its torch reused), megatron-core and this
#      package installed offline from tools/gpu_wheels/ (filled beforehand by tools/gpu_wheels.sh)
#   2. pytest tests/gpu -q
#   3. `train` of the CPU demo's config on the GPU, its engine colocated (rollout.placement colocated):
#      once with the engine on the CPU (weights device-to-host), once with the engine on the same GPU
#      (rollout.embedded.device cuda: weights device-to-device through CUDA IPC, cache freed when idle)
#   4. tools/bench_fused_output.py on CUDA in bf16 at 4096 x h 2048 x V 65536 and 16384 x h 4096 x V 151936
#      (TP=1: one GPU; TP=2 would put two gloo ranks on it and time host copies, not the op)
#   tools/bench_vocab_parallel.py has no CUDA path (CPU gloo ranks only), so it is not run.
#
# Each step has its own timeout inside a total budget (GPU_CHECK_BUDGET_S, 570 s); a failed
# step is recorded and the next one runs; the exit status is non-zero if any step failed.
# Writes $OUT/gpu_summary.md (./gpu_summary.md without $OUT) and the full log beside it.
# Reads the GPU's name and nothing else from nvidia-smi: it never resets or reconfigures it.
#
#     bash tools/gpu_wheels.sh                  # where pip reaches an index
#     bash tools/gpu_check.sh                   # on the GPU machine, tools/gpu_wheels/ carried
#     GPU_CHECK_DRY_RUN=1 bash tools/gpu_check.sh   # print the commands, run none
set -u

cd "$(dirname "$0")/.." || exit 2
REPO="$PWD"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
SYS_PY="${GPU_CHECK_PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/tools/gpu_wheels}"
VENV="/tmp/entr_gpu_check_venv"
VENV_PY="$VENV/bin/python"
OUT_DIR="${OUT:-$REPO}"
SUMMARY="$OUT_DIR/gpu_summary.md"
FULL_LOG="$OUT_DIR/gpu_check.log"
LOGS="$(mktemp -d /tmp/entr_gpu_check.XXXXXX)"
export PYTHONUNBUFFERED=1

# The issue's GPU sizes: TOKENS HIDDEN VOCAB.
BENCH_SIZES=("4096 2048 65536" "16384 4096 151936")

STEP_NAMES=()
STEP_RCS=()
STEP_WALLS=()
STEP_NOTES=()
STEP_LOGS=()
T_START="$(date +%s)"
FAILED=0

# run_step NAME CAP_S CMD...: runs CMD under `timeout` (the smaller of CAP_S and what is left
# of the budget), its output to a log of its own; records exit status and wall time.
run_step() {
    local name="$1" cap="$2"
    shift 2
    local idx="${#STEP_NAMES[@]}"
    local log="$LOGS/step$idx.log"
    local left=$((BUDGET_S - ($(date +%s) - T_START)))
    local limit=$((cap < left ? cap : left))
    STEP_NAMES+=("$name")
    STEP_LOGS+=("$log")
    : >"$log"
    if [ "$DRY_RUN" = 1 ]; then
        printf '+ timeout %ss %s\n' "$cap" "$(printf '%q ' "$@")"
        if [ "$#" -eq 3 ] && [ "$1 $2" = "bash -c" ] && declare -F "$3" >/dev/null; then
            declare -f "$3" | sed 's/^/    /'
        fi
        STEP_RCS+=("dry run")
        STEP_WALLS+=("-")
        STEP_NOTES+=("dry run: timeout ${cap} s; $(printf '%q ' "$@")")
        return 0
    fi
    if [ "$limit" -lt 5 ]; then
        STEP_RCS+=("not run")
        STEP_WALLS+=("0 s")
        STEP_NOTES+=("the ${BUDGET_S} s budget was spent")
        FAILED=1
        return 1
    fi
    echo "== $name (timeout ${limit} s): $*"
    local t0 t1 rc
    t0="$(date +%s%N)"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    t1="$(date +%s%N)"
    STEP_RCS+=("$rc")
    STEP_WALLS+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f s", (b - a) / 1e9 }')")
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        STEP_NOTES+=("timed out after ${limit} s")
    elif [ "$rc" -ne 0 ]; then
        STEP_NOTES+=("failed; its log's tail is below")
    else
        STEP_NOTES+=("")
    fi
    [ "$rc" -eq 0 ] || FAILED=1
    echo "   exit $rc, ${STEP_WALLS[$idx]}"
    return "$rc"
}

# A step recorded without running (it does not count as a failure).
skip_step() {
    STEP_NAMES+=("$1")
    STEP_RCS+=("skipped")
    STEP_WALLS+=("-")
    STEP_NOTES+=("$2")
    STEP_LOGS+=("")
    if [ "$DRY_RUN" = 1 ]; then
        echo "# skipped: $1 ($2)"
    fi
}

# The venv over the machine's Python, with nothing of its own: its pip (and, before 3.12, an old
# setuptools) would shadow the machine's. Where that Python is itself a venv (the H200 image's
# is /opt/torch/.venv), --system-site-packages reaches the base interpreter's packages, not its
# own, so a .pth file adds its site-packages (after the venv's own: ours win).
# shellcheck disable=SC2317  # run through `bash -c` (exported), not called here
make_venv() {
    "$SYS_PY" -m venv --clear --without-pip --system-site-packages "$VENV" || return 1
    if ! "$VENV_PY" -c 'import torch' 2>/dev/null; then
        local site
        site="$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
        "$SYS_PY" -c '
import sysconfig
p = sysconfig.get_paths()
for d in dict.fromkeys([p["purelib"], p["platlib"]]):
    print(f"import site; site.addsitedir({d!r})")
' >"$site/_gpu_check_parent.pth" || return 1
        echo "added $SYS_PY's site-packages through $site/_gpu_check_parent.pth:"
        cat "$site/_gpu_check_parent.pth"
    fi
    if ! "$VENV_PY" -m pip --version >/dev/null 2>&1; then
        "$VENV_PY" -m ensurepip || return 1
    fi
    "$VENV_PY" -c 'import torch, pip; print("torch", torch.__version__, "from", torch.__file__); print("pip", pip.__version__, "from", pip.__file__)'
}

# Offline, from the carried wheels only; what the machine has already (torch, numpy, ...) stays.
# First a resolved install (fails if the machine lacks a dependency), then the two carried
# wheels again over whatever copy of them the machine had. PYTHONSAFEPATH keeps this checkout
# (and any entr_megatron.egg-info in it) out of sight.
# shellcheck disable=SC2317  # run through `bash -c` (exported), not called here
install_wheels() {
    export PYTHONSAFEPATH=1
    ls -l "$WHEELS" || return 1
    local -a mcore ours
    mcore=("$WHEELS"/megatron_core-0.16.1-*.whl)
    ours=("$WHEELS"/entr_megatron-*.whl)
    if [ "${#mcore[@]}" -ne 1 ] || [ ! -f "${mcore[0]}" ] || [ "${#ours[@]}" -ne 1 ] || [ ! -f "${ours[0]}" ]; then
        echo "want one megatron_core-0.16.1 and one entr_megatron wheel in $WHEELS (tools/gpu_wheels.sh)"
        return 1
    fi
    "$VENV_PY" -m pip install --no-index --find-links "$WHEELS" --no-cache-dir \
        --disable-pip-version-check "${mcore[0]}" "${ours[0]}" || return 1
    "$VENV_PY" -m pip install --no-index --no-deps --force-reinstall --no-cache-dir \
        --disable-pip-version-check "${mcore[0]}" "${ours[0]}"
}

# The installed package, not this checkout (PYTHONSAFEPATH keeps the working directory off
# sys.path), so that a file missing from the wheel shows here.
# shellcheck disable=SC2317  # run through `bash -c` (exported), not called here
check_import() {
    PYTHONSAFEPATH=1 "$VENV_PY" -c '
import entr_megatron, megatron.core, torch
print("entr_megatron from", entr_megatron.__file__)
print("megatron.core", megatron.core.__version__, "from", megatron.core.__file__)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__, "from", triton.__file__)
except ImportError:
    print("triton: not installed (the fused op falls back to its chunked PyTorch path)")
assert torch.cuda.is_available(), "torch sees no CUDA device"
'
}

# The benchmark's baselines (Liger, CCE), when carried: their only needs, torch and triton, are
# the image's. A failure here leaves them out of the benchmark, nothing else.
# shellcheck disable=SC2317  # run through `bash -c` (exported), not called here
install_baselines() {
    export PYTHONSAFEPATH=1
    local -a found=()
    local w
    for w in "$WHEELS"/liger_kernel-*.whl "$WHEELS"/cut_cross_entropy-*.whl; do
        [ -f "$w" ] && found+=("$w")
    done
    if [ "${#found[@]}" -eq 0 ]; then
        echo "no liger_kernel / cut_cross_entropy wheels in $WHEELS"
        return 1
    fi
    "$VENV_PY" -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check "${found[@]}"
}

export -f make_venv install_wheels install_baselines check_import
export SYS_PY VENV VENV_PY WHEELS

# ---- the steps ------------------------------------------------------------------------------

if [ "$DRY_RUN" != 1 ] && [ ! -d "$WHEELS" ]; then
    echo "warning: $WHEELS is missing: run tools/gpu_wheels.sh and carry tools/gpu_wheels" >&2
fi
run_step "nvidia-smi --query-gpu (read only)" 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
run_step "torch and CUDA versions" 60 "$SYS_PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())'
run_step "venv $VENV" 90 bash -c make_venv
run_step "pip install --no-index (tools/gpu_wheels)" 120 bash -c install_wheels
run_step "pip install the benchmark's baselines (Liger, CCE)" 60 bash -c install_baselines
run_step "import the installed package" 60 bash -c check_import
run_step "pytest tests/gpu -q" 150 env PYTHONSAFEPATH=1 "$VENV_PY" -m pytest tests/gpu -q -p no:cacheprovider
skip_step "tools/bench_vocab_parallel.py" "no CUDA path: it runs CPU gloo ranks only"
# The main job on one GPU: the CPU demo's config, the learner on the GPU, the embedded engine beside
# it (rollout.placement colocated: weights device-to-host into its shared staging copy, no NCCL group).
run_step "train: the CPU demo's config on one GPU, colocated engine" 200 \
    env PYTHONSAFEPATH=1 "$VENV_PY" -m entr_megatron.cli.main train --config examples/cpu_demo.yaml --max-steps 20 \
    launcher.device=cuda launcher.gpus_per_node=1 rollout.placement=colocated sft.steps=100 \
    logging.run_dir=/tmp/entr_gpu_check_colocated
# The same with the engine on the GPU too: one device holds the learner and the engine.
run_step "train: the CPU demo's config, learner and engine on one GPU" 150 \
    env PYTHONSAFEPATH=1 "$VENV_PY" -m entr_megatron.cli.main train --config examples/cpu_demo.yaml --max-steps 20 \
    launcher.device=cuda launcher.gpus_per_node=1 rollout.placement=colocated rollout.embedded.device=cuda \
    sft.steps=100 logging.run_dir=/tmp/entr_gpu_check_colocated_gpu_engine
for size in "${BENCH_SIZES[@]}"; do
    read -r tokens hidden vocab <<<"$size"
    run_step "bench_fused_output $tokens x h $hidden x V $vocab" 150 \
        "$VENV_PY" tools/bench_fused_output.py --device cuda --tp 1 --dtype bfloat16 \
        --tokens "$tokens" --hidden "$hidden" --vocab "$vocab"
done

# ---- the summary ----------------------------------------------------------------------------

# log_line LOG REGEX: the first line of LOG matching REGEX; fails when there is none.
log_line() { [ -n "$1" ] && [ -s "$1" ] && grep -m 1 -E "$2" "$1"; }

# step_log NAME: the log of the step called NAME (empty if there is none).
step_log() {
    local i
    for i in "${!STEP_NAMES[@]}"; do
        [ "${STEP_NAMES[$i]}" = "$1" ] && echo "${STEP_LOGS[$i]}" && return
    done
}

# The benchmark's own table as it printed it: the line above "| TP | method ..." (its header:
# sizes, dtype, versions), the table's rows, and its GEMM-efficiency line(s) below it.
bench_table() {
    awk '/^\| TP \| method/ && !done { print prev; t = 1 }
         t && /^\|/ { print; next }
         t { t = 0; done = 1 }
         { prev = $0 }' "$1"
    grep -E '^TP=[0-9]+: one output-layer GEMM' "$1"
}

{
    echo "# GPU check (tools/gpu_check.sh)"
    echo
    [ "$DRY_RUN" = 1 ] && echo "**Dry run**: no command ran; each step lists what would have." && echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO" status --porcelain 2>/dev/null | grep -q . && echo ' (with uncommitted changes)')"
    echo "- GPU (nvidia-smi): $(log_line "$(step_log "nvidia-smi --query-gpu (read only)")" . || echo "dry run / not read")"
    echo "- torch / CUDA: $(log_line "$(step_log "torch and CUDA versions")" '^torch ' || echo "dry run / not read")"
    echo "- triton: $(log_line "$(step_log "import the installed package")" '^triton' || echo "dry run / not read")"
    echo "- budget: ${BUDGET_S} s; total wall: $(($(date +%s) - T_START)) s"
    echo
    echo "| step | exit | wall | note |"
    echo "|---|---|---|---|"
    for i in "${!STEP_NAMES[@]}"; do
        echo "| ${STEP_NAMES[$i]} | ${STEP_RCS[$i]} | ${STEP_WALLS[$i]} | ${STEP_NOTES[$i]//|/\\|} |"
    done
    for i in "${!STEP_NAMES[@]}"; do
        log="${STEP_LOGS[$i]}"
        case "${STEP_NAMES[$i]}" in
        pytest*)
            echo
            echo "## ${STEP_NAMES[$i]}"
            echo
            if [ -s "$log" ]; then
                line="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$log" | tail -n 1)"
                echo "${line:-no summary line (exit ${STEP_RCS[$i]})}"
            else
                echo "${STEP_RCS[$i]}"
            fi
            ;;
        bench_fused_output*)
            echo
            echo "## ${STEP_NAMES[$i]}"
            echo
            if [ "${STEP_RCS[$i]}" = 0 ]; then
                bench_table "$log"
            elif [ -s "$log" ]; then
                echo "exit ${STEP_RCS[$i]}"
            else
                echo "${STEP_RCS[$i]}"
            fi
            ;;
        esac
        if [ -s "$log" ] && [ "${STEP_RCS[$i]}" != 0 ]; then
            echo
            echo "Tail of the log of '${STEP_NAMES[$i]}':"
            echo
            echo '```'
            tail -n 25 "$log"
            echo '```'
        fi
    done
} >"$SUMMARY"

for i in "${!STEP_NAMES[@]}"; do
    if [ -n "${STEP_LOGS[$i]}" ]; then
        echo "===== ${STEP_NAMES[$i]}: exit ${STEP_RCS[$i]}, ${STEP_WALLS[$i]}"
        cat "${STEP_LOGS[$i]}"
    fi
done >"$FULL_LOG"
rm -rf "$LOGS"

echo "wrote $SUMMARY and $FULL_LOG"
exit "$FAILED"
