#!/usr/bin/env bash
# Reproduces recipes/RESULTS.md: Gemma 3 270M fine-tuned from the same pretrained start with
#   ce    CE only,
#   hard  CE + WEIGHT * (1 - F_BERT), hard greedy matching,
#   soft  CE + WEIGHT * (1 - F_BERT), softmax matching at TEMPERATURE,
# each with every seed of SEEDS (a seed fixes the batches, so the three runs of a seed see the
# same examples in the same order), for summarization (XSum sample) and es->en translation (Bible
# sample). Candidates are teacher-forced; the BERTScore term goes through the vocabulary bridge.
# A run whose results.json exists is skipped, so the script resumes where it stopped; a run
# folder without one (a run cut off: these short runs save no checkpoint) is run again from the
# start (--overwrite).
# Runs under $RUNS_DIR/<task>/<run>-s<seed>/ (RUNS_DIR: runs/results; hard and soft runs at
# another WEIGHT than 1.0 are named hard-w<WEIGHT>, soft-w<WEIGHT>); their results, logs and
# test outputs are copied to $KEEP/<task>/ (KEEP: recipes/results). Then:
#   python recipes/summarize_results.py [$KEEP]
# The runs of RESULTS.md:  bash recipes/run_results.sh
#                          TASKS=xsum RUNS="hard soft" WEIGHT=10 bash recipes/run_results.sh
# Their re-run with the fixed training signal (RESULTS.md), beside them, not over them:
#   RUNS_DIR=runs/fixed-gradient KEEP=recipes/results/fixed-gradient bash recipes/run_results.sh
#   (then the same with RUNS="hard soft" WEIGHT=10)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SEEDS=${SEEDS:-"0 1 2"}
WEIGHT=${WEIGHT:-1.0}
TEMPERATURE=${TEMPERATURE:-0.05}
TASKS=${TASKS:-"xsum bible-es-en"}
RUNS_DIR=${RUNS_DIR:-runs/results}
KEEP=${KEEP:-recipes/results}
RUNS=${RUNS:-"ce hard soft"}
suffix=""
[ "$WEIGHT" != "1.0" ] && suffix="-w$WEIGHT"
declare -A STEPS=([xsum]=${XSUM_STEPS:-16} [bible-es-en]=${BIBLE_STEPS:-40})
first_seed=${SEEDS%% *}
for task in $TASKS; do
    for seed in $SEEDS; do
        for run in $RUNS; do
            name=$run
            [ "$run" != ce ] && name=$run$suffix
            out=$RUNS_DIR/$task/$name-s$seed
            [ -f "$out/results.json" ] && continue
            case $run in
                ce) loss=(--set loss.weight=0.0) ;;
                hard) loss=(--set loss.weight="$WEIGHT" --set loss.matching=hard) ;;
                soft) loss=(--set loss.weight="$WEIGHT" --set loss.matching=softmax
                            --set loss.temperature="$TEMPERATURE") ;;
            esac
            # every run starts from the same model and decodes greedily: the zero-shot outputs
            # are the same for all, so one run (the first seed's CE) records them
            before=false
            [ "$run" = ce ] && [ "$seed" = "$first_seed" ] && before=true
            mkdir -p "$out"
            python recipes/finetune.py --config "recipes/configs/$task-gemma.yaml" \
                --output_dir "$out" --set train.seed="$seed" --set train.steps="${STEPS[$task]}" \
                --set train.lr_warmup_steps=3 --set train.eval_every=0 --set train.save_every=0 \
                --set train.save_model=false --set eval.before="$before" "${loss[@]}" --overwrite \
                > "$out/stdout.log" 2>&1
            keep=$KEEP/$task/$name-s$seed
            mkdir -p "$keep"
            cp "$out"/log.jsonl "$out"/results.json "$out"/test_outputs*.txt "$keep/"
        done
    done
done
