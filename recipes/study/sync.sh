#!/usr/bin/env bash
# Copy the study's small outputs (logs, results, test and dev outputs) of every run (stage 1,
# stage 2's arms, equal-compute/'s runs of other lengths) from a run folder into the
# repository's recipes/results/study/ (or the second argument's folder), to commit as they
# arrive; and a LoRA run's best/ adapter (a few MB: stage 1's converged start, which stage 2
# starts from in any later session), without the tokenizer (the configured generator's own).
#   bash recipes/study/sync.sh /work/wt-study/runs/study
#   bash recipes/study/sync.sh /work/wt-xsum/runs/study-xsum recipes/results/study/xsum
set -euo pipefail
cd "$(dirname "$0")/../.."
FROM=${1:-runs/study}
TO=${2:-recipes/results/study}
for run in "$FROM"/stage1-seed* "$FROM"/stage2-seed*/* "$FROM"/equal-compute/*; do
    [ -f "$run/log.jsonl" ] || continue
    rel=${run#"$FROM"/}
    mkdir -p "$TO/$rel"
    find "$run" -maxdepth 1 -type f \( -name '*.jsonl' -o -name '*.json' -o -name '*.txt' \
        -o -name '*.png' \) -exec cp {} "$TO/$rel/" \;
    # the dev answers at each evaluation (a few KB): summary.py's dev curves re-score them
    if [ -d "$run/dev_outputs" ]; then
        mkdir -p "$TO/$rel/dev_outputs"
        cp "$run"/dev_outputs/step_*.txt "$TO/$rel/dev_outputs/"
    fi
    if [ -f "$run/best/adapter_config.json" ]; then
        mkdir -p "$TO/$rel/best"
        cp "$run"/best/{adapter_config.json,adapter_model.safetensors,config.json,best.json} \
            "$TO/$rel/best/"
    fi
done
