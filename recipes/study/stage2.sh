#!/usr/bin/env bash
# Stage 2 of the efficacy study (issue 25): every arm of recipes/study/arms.yaml from the same
# stage-1 checkpoint (START/stage1-seed<N>/best, see stage1.sh; START defaults to OUT, and
# START=recipes/results/study takes the committed LoRA adapters), with the same seed (so the
# same examples in the same order) and the same number of steps; each run into
# runs/study/stage2-seed<N>/<arm>/. Settings: recipes/configs/bible-es-en-gemma-stage2.yaml, the
# arm's --set overrides on top (EXTRA="--set k=v ..." adds more to every arm). Resumable and one
# process per core (recipes/study/lib.sh); the jobs run seed by seed, so seed 0's arms finish
# first. Core-seconds: the "cpu" field of each log.jsonl.
#   bash recipes/study/stage2.sh                                  # all arms, seeds 0 1 2
#   SEEDS="0" ARMS="ce berttune" CORES="1" bash recipes/study/stage2.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"  # at the repository root, one thread a process, SEEDS and OUT
CONFIG=${CONFIG:-recipes/configs/bible-es-en-gemma-stage2.yaml}
START=${START:-$OUT}
ARMS_FILE=${ARMS_FILE:-recipes/study/arms.yaml}
ARMS=${ARMS:-$(python recipes/study/arms.py names "$ARMS_FILE")}
JOBS=()
for seed in $SEEDS; do
    start=$START/stage1-seed$seed/best
    if [ ! -f "$start/config.json" ]; then
        echo "seed $seed: no stage-1 checkpoint at $start (run recipes/study/stage1.sh)" >&2
        exit 1
    fi
    for arm in $ARMS; do
        # the arm's script and overrides, one word each (arms.py refuses values with spaces)
        arm_args=$(python recipes/study/arms.py args "$ARMS_FILE" "$arm" "$CONFIG")
        JOBS+=("$OUT/stage2-seed$seed/$arm $arm_args --init_from $start --set train.seed=$seed \
--set eval.before=false ${EXTRA:-}")
    done
done
run_queue
