#!/usr/bin/env bash
# Reproduces recipes/RESULTS.md: for each task, a CE stage, then three continuations from it with
# the same steps and seed: CE only, CE + 1.0 * (1 - F_BERT) with hard matching, and with softmax
# matching (T = 0.05). Outputs under runs/results/; logs and results are copied to recipes/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CE_STEPS=${CE_STEPS:-200}
STEPS=${STEPS:-50}
for task in xsum bible-es-en; do
    config=recipes/configs/${task}-bert2bert.yaml
    out=runs/results/${task}
    python recipes/finetune.py --config "$config" --output_dir "$out/ce-stage" \
        --set train.steps="$CE_STEPS" --set train.eval_every=100 --set train.save_every=0 \
        --set eval.before=false
    common=(--config "$config" --init_from "$out/ce-stage/model" --set train.steps="$STEPS"
            --set train.eval_every=$((STEPS / 2)) --set train.save_every=0
            --set train.lr_warmup_steps=0)
    python recipes/finetune.py "${common[@]}" --output_dir "$out/ce" --set loss.weight=0.0
    python recipes/finetune.py "${common[@]}" --output_dir "$out/hard" \
        --set loss.weight=1.0 --set loss.matching=hard
    python recipes/finetune.py "${common[@]}" --output_dir "$out/soft" \
        --set loss.weight=1.0 --set loss.matching=softmax --set loss.temperature=0.05
    for run in ce-stage ce hard soft; do
        mkdir -p "recipes/results/${task}/${run}"
        cp "$out/$run/log.jsonl" "$out/$run/results.json" "$out/$run/curves.png" "$out/$run/test_outputs.txt" \
            "recipes/results/${task}/${run}/"
    done
done
