# Shared by the study's drivers (stage1.sh, stage2.sh): resumable runs, one process per core.
# A job is "OUT ARGS...": recipes/finetune.py (or the script in $SCRIPT_<n>) writing OUT. Jobs
# are dealt to the cores in order (job i on core CORES[i mod #cores], one thread), the jobs of a
# core one after another, so the first jobs of the list finish first.
# Sourcing it moves to the repository root and sets what both drivers share.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
SEEDS=${SEEDS:-"0 1 2"}
OUT=${OUT:-runs/study}

# run_job OUT CORE SCRIPT ARGS...: skip a finished run (results.json has the test score after
# training), continue one with checkpoints (--resume), else start it; output to OUT/stdout.log;
# a run that finishes has its checkpoints removed (KEEP_CHECKPOINTS=1 keeps them).
run_job() {
    local out=$1 core=$2 script=$3
    shift 3
    if [ -f "$out/results.json" ] && grep -q '"after"' "$out/results.json"; then
        echo "$out: done"
        return
    fi
    local resume=()
    # finetune.py saves checkpoint_<step> (accelerate), grpo.py checkpoint-<step> (TRL)
    compgen -G "$out/checkpoints/checkpoint[_-]*" > /dev/null && resume=(--resume)
    mkdir -p "$out"
    echo "$out: core $core ${resume[*]:-(new)}"
    taskset -c "$core" python "$script" --output_dir "$out" "$@" "${resume[@]}" \
        >> "$out/stdout.log" 2>&1
    # a finished run needs no checkpoint (1.8 GB for Gemma with AdamW's state); KEEP_CHECKPOINTS=1
    if [ -z "${KEEP_CHECKPOINTS:-}" ] && grep -q '"after"' "$out/results.json" 2> /dev/null; then
        rm -rf "$out/checkpoints"
    fi
}

# run_queue: the jobs in the array JOBS (each a string "OUT SCRIPT ARGS...", split on spaces)
# over the cores in CORES; exits non-zero when a job failed (the others still run).
run_queue() {
    local -a cores
    read -r -a cores <<< "${CORES:-0 1}"
    local pids=() index
    for index in "${!cores[@]}"; do
        (
            status=0
            for i in "${!JOBS[@]}"; do
                if (( i % ${#cores[@]} == index )); then
                    read -r -a job <<< "${JOBS[$i]}"
                    run_job "${job[0]}" "${cores[$index]}" "${job[@]:1}" || status=$?
                fi
            done
            exit $status
        ) &
        pids+=($!)
    done
    local failed=0 pid
    for pid in "${pids[@]}"; do
        wait "$pid" || failed=1
    done
    return $failed
}
