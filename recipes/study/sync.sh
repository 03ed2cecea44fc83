#!/usr/bin/env bash
# Copy the study's small outputs (logs, results, test and dev outputs) from a run folder into the
# repository's recipes/results/study/, to commit as they arrive; and a LoRA run's best/ adapter
# (a few MB: stage 1's converged start, which stage 2 starts from in any later session), without
# the tokenizer (the configured generator's own).
#   bash recipes/study/sync.sh /work/wt-study/runs/study
set -euo pipefail
cd "$(dirname "$0")/../.."
FROM=${1:-runs/study}
for run in "$FROM"/stage1-seed* "$FROM"/stage2-seed*/*; do
    [ -f "$run/log.jsonl" ] || continue
    rel=${run#"$FROM"/}
    mkdir -p "recipes/results/study/$rel"
    find "$run" -maxdepth 1 -type f \( -name '*.jsonl' -o -name '*.json' -o -name '*.txt' \
        -o -name '*.png' \) -exec cp {} "recipes/results/study/$rel/" \;
    # the dev answers at each evaluation (a few KB): summary.py's dev curves re-score them
    if [ -d "$run/dev_outputs" ]; then
        mkdir -p "recipes/results/study/$rel/dev_outputs"
        cp "$run"/dev_outputs/step_*.txt "recipes/results/study/$rel/dev_outputs/"
    fi
    if [ -f "$run/best/adapter_config.json" ]; then
        mkdir -p "recipes/results/study/$rel/best"
        cp "$run"/best/{adapter_config.json,adapter_model.safetensors,config.json,best.json} \
            "recipes/results/study/$rel/best/"
    fi
done
