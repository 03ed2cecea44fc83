#!/usr/bin/env bash
# The budget measurements of issue 25 (item 4) on ONE core: a Gemma 3 270M CE step on the Bible
# config (batch 8, fp32) with and without train.freeze_embeddings, the dev-CE evaluation on 100
# validation verses, peak RSS; then the stage-1 probe: the dev-CE curve at two learning rates.
#   bash recipes/study/measure.sh   # defaults: CORE=1 STEPS=4 FREEZES=false PROBE_STEPS=40
#                                   #           LRS="1e-4 5e-5" FREEZE=true WHAT="step probe"
# Runs under runs/study/measure/; each run's log.jsonl holds the step times (train lines' "time")
# and the dev evaluations; time.txt holds /usr/bin/time -v (peak RSS).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
CORE=${CORE:-1}
STEPS=${STEPS:-4}
FREEZES=${FREEZES:-"false"}
PROBE_STEPS=${PROBE_STEPS:-40}
LRS=${LRS:-"1e-4 5e-5"}
WHAT=${WHAT:-"step probe"}
common=(--config recipes/configs/bible-es-en-gemma.yaml --set train.batch_size=8
        --set train.steps=10000 --set eval.before=false --set data.max_validation=100
        --set data.id=ref --set train.early_stopping_metric=dev_ce --set train.save_every=0)
run() {  # run NAME ARGS...: one process on core $CORE, its peak RSS in time.txt
    local out=runs/study/measure/$1; shift
    rm -rf "$out"; mkdir -p "$out"
    /usr/bin/time -v -o "$out/time.txt" taskset -c "$CORE" python recipes/finetune.py \
        "${common[@]}" --output_dir "$out" "$@" > "$out/stdout.log" 2>&1
}
if [[ " $WHAT " == *" step "* ]]; then  # the probes' first steps are the frozen ones
    for freeze in $FREEZES; do
        run "step-freeze-$freeze" --set train.freeze_embeddings="$freeze" \
            --set train.eval_every="$STEPS" --stop_after "$STEPS"
    done
fi
if [[ " $WHAT " == *" probe "* ]]; then
    for lr in $LRS; do
        run "probe-lr$lr" --set train.freeze_embeddings="${FREEZE:-true}" \
            --set train.learning_rate="$lr" --set train.lr_warmup_steps=5 \
            --set train.eval_every=10 --stop_after "$PROBE_STEPS"
    done
fi
