#!/usr/bin/env bash
# Stage 1 of the efficacy study (issue 25): Gemma 3 270M trained with CE alone on es->en (the
# vendored Bible sample: 2000 train / 200 dev / 200 test verses) until the dev CE stops improving,
# one run per seed, each into runs/study/stage1-seed<N>/; its best/ folder (the best dev-CE step's
# model) is where every stage-2 arm starts (--init_from runs/study/stage1-seed<N>/best).
# Settings: recipes/configs/bible-es-en-gemma-stage1.yaml (EXTRA="--set k=v ..." adds overrides).
# One process per core and resumable (recipes/study/lib.sh): seed i runs on core
# CORES[i mod #CORES]; a finished seed is skipped, one with checkpoints (every train.save_every
# steps) continues from the last; each seed's output goes to its stdout.log (appended).
# Core-seconds: the "cpu" field of log.jsonl. OUT (runs/study) and CONFIG change where and what.
#   bash recipes/study/stage1.sh                      # seeds 0 1 2 on cores 0 and 1
#   SEEDS="0" CORES="1" bash recipes/study/stage1.sh  # one seed on core 1
set -euo pipefail
source "$(dirname "$0")/lib.sh"  # at the repository root, one thread a process, SEEDS and OUT
CONFIG=${CONFIG:-recipes/configs/bible-es-en-gemma-stage1.yaml}
JOBS=()
before=true  # the pretrained model's test score is the same for every seed (greedy): once
for seed in $SEEDS; do
    JOBS+=("$OUT/stage1-seed$seed recipes/finetune.py --config $CONFIG --set train.seed=$seed \
--set eval.before=$before ${EXTRA:-}")
    before=false
done
run_queue
