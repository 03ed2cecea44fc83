#!/usr/bin/env bash
# Stage 1 of the efficacy study (issue 25): Gemma 3 270M trained with CE alone on es->en (the
# vendored Bible sample: 2000 train / 200 dev / 200 test verses) until the dev CE stops improving,
# one run per seed, each into runs/study/stage1-seed<N>/; its best/ folder (the best dev-CE step's
# model) is where every stage-2 arm starts (--init_from runs/study/stage1-seed<N>/best).
# Settings: recipes/configs/bible-es-en-gemma-stage1.yaml (EXTRA="--set k=v ..." adds overrides).
# One process per core: seed i runs on core CORES[i mod #CORES] (taskset, one thread), the seeds
# of one core one after another. Resumable: a seed whose results.json has its test score after
# training is skipped; one with checkpoints (every train.save_every steps) continues from the
# last (--resume); each seed's output goes to its stdout.log (appended). Core-seconds: the "cpu"
# field of log.jsonl. OUT (runs/study) and CONFIG change where and what.
#   bash recipes/study/stage1.sh                      # seeds 0 1 2 on cores 0 and 1
#   SEEDS="0" CORES="1" bash recipes/study/stage1.sh  # one seed on core 1
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
SEEDS=${SEEDS:-"0 1 2"}
CORES=${CORES:-"0 1"}
CONFIG=${CONFIG:-recipes/configs/bible-es-en-gemma-stage1.yaml}
OUT=${OUT:-runs/study}
read -r -a cores <<< "$CORES"
read -r -a seeds <<< "$SEEDS"
read -r -a extra <<< "${EXTRA:-}"

run_seed() {  # run_seed SEED CORE
    local seed=$1 core=$2 out=$OUT/stage1-seed$1
    # results.json is written before training too (the test score before): done = "after" in it
    if [ -f "$out/results.json" ] && grep -q '"after"' "$out/results.json"; then
        echo "seed $seed: done ($out/results.json)"
        return
    fi
    local resume=()
    compgen -G "$out/checkpoints/checkpoint_*" > /dev/null && resume=(--resume)
    # the pretrained model's test score is the same for every seed (greedy): the first records it
    local before=false
    [ "$seed" = "${seeds[0]}" ] && before=true
    mkdir -p "$out"
    echo "seed $seed: core $core ${resume[*]} -> $out/stdout.log"
    taskset -c "$core" python recipes/finetune.py --config "$CONFIG" --output_dir "$out" \
        --set train.seed="$seed" --set eval.before="$before" "${resume[@]}" "${extra[@]}" \
        >> "$out/stdout.log" 2>&1
}

run_core() {  # run_core INDEX: the seeds whose position modulo #cores is INDEX, in order
    local index=$1 status=0
    for i in "${!seeds[@]}"; do
        if (( i % ${#cores[@]} == index )); then
            run_seed "${seeds[$i]}" "${cores[$index]}" || status=$?
        fi
    done
    return $status
}

pids=()
for index in "${!cores[@]}"; do
    run_core "$index" &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
exit $failed
