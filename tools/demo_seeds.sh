#!/usr/bin/env bash
# The CPU demo's RL phase at seeds 0-2 from one SFT model, optionally alternating with an older
# commit's code on the same machine (docs/DEMOS.md's figures and its code-vs-machine check).
#
#   bash tools/demo_seeds.sh SFT_MODEL_DIR OUT [OLD_COMMIT]
#
# SFT_MODEL_DIR: the demo's warm-up (e.g. runs/cpu_demo/sft/model). Each run prints its result JSON
# (held-out accuracy before and after RL, RL wall) to OUT/<side>_s<seed>.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=$(realpath "$1"); OUT=$(realpath -m "$2"); OLD=${3:-}
mkdir -p "$OUT"
sides=(new)
if [[ -n $OLD ]]; then
    git -C "$ROOT" worktree add -f "$OUT/old_tree" "$OLD" >/dev/null
    trap 'git -C "$ROOT" worktree remove --force "$OUT/old_tree"' EXIT
    sides+=(old)
fi
for seed in 0 1 2; do
    for side in "${sides[@]}"; do
        tree=$ROOT; [[ $side == old ]] && tree=$OUT/old_tree
        echo "seed $seed, $side code, load $(cut -d' ' -f1 /proc/loadavg)" >&2
        (cd "$tree" && "$ROOT/.venv/bin/python" -m entr_megatron.cli.main train --config examples/cpu_demo.yaml \
            --run-dir "$OUT/${side}_s$seed" model.path="$MODEL" model.architecture=null controller.seed=$seed sft=null \
            logging.progress_bar=false) > "$OUT/${side}_s$seed.json" 2> "$OUT/${side}_s$seed.log"
        tail -n 1 "$OUT/${side}_s$seed.json" >&2
    done
done
