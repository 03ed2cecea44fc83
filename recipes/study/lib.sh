# Shared by the study's drivers (stage1.sh, stage2.sh): resumable runs, one process per core.
# A job is "OUT ARGS...": recipes/finetune.py (or the script in $SCRIPT_<n>) writing OUT. Jobs
# are dealt to the cores in order (job i on core CORES[i mod #cores], one thread), the jobs of a
# core one after another, so the first jobs of the list finish first.
# Sourcing it moves to the repository root and sets what both drivers share.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
SEEDS=${SEEDS:-"0 1 2"}
OUT=${OUT:-runs/study}
CORES=${CORES:-"0 1"}  # one run per core at a time

# finished OUT: the run has its test score after training (results.json's "after")
finished() {
    [ -f "$1/results.json" ] && grep -q '"after"' "$1/results.json"
}

# check_budget: refuse, naming the setting, a queue that this machine cannot hold, before any job
# starts: a core in CORES that taskset cannot run a process on (every job of it would fail),
# or less free disk under OUT than the runs going at once may write (GB_PER_RUN, default 2: a
# Gemma 3 270M checkpoint with AdamW's state is 1.8 GB, kept until its run finishes).
check_budget() {
    local -a cores
    read -r -a cores <<< "$CORES"
    if [ ${#cores[@]} -eq 0 ]; then
        echo "CORES is empty: name at least one core (e.g. CORES=\"0 1\")" >&2
        return 1
    fi
    local core
    for core in "${cores[@]}"; do
        if ! taskset -c "$core" true 2> /dev/null; then
            echo "CORES=\"$CORES\": taskset cannot run a process on core '$core'" \
                "(this machine has $(nproc --all) CPUs, numbered from 0)" >&2
            return 1
        fi
    done
    if ! [[ ${GB_PER_RUN:-2} =~ ^[0-9]+([.][0-9]+)?$ ]]; then
        echo "GB_PER_RUN=$GB_PER_RUN: expected a number of GB (e.g. 2)" >&2
        return 1
    fi
    local pending=0 entry
    local -a fields
    for entry in "${JOBS[@]}"; do
        read -r -a fields <<< "$entry"
        finished "${fields[0]}" || pending=$((pending + 1))
    done
    local at_once=$(( pending < ${#cores[@]} ? pending : ${#cores[@]} ))
    mkdir -p "$OUT"
    local free_kb
    free_kb=$(df -Pk "$OUT" | awk 'NR == 2 {print $4}')
    if ! awk -v free="$free_kb" -v runs="$at_once" -v each="${GB_PER_RUN:-2}" \
        'BEGIN { exit !(free / 1048576 >= runs * each) }'; then
        echo "OUT=$OUT has $(awk -v f="$free_kb" 'BEGIN { printf "%.1f", f / 1048576 }') GB" \
            "free; $at_once runs at once (CORES=\"$CORES\") may write" \
            "GB_PER_RUN=${GB_PER_RUN:-2} GB each: free space, or name fewer CORES" >&2
        return 1
    fi
}

# run_job OUT CORE SCRIPT ARGS...: skip a finished run (results.json has the test score after
# training), continue one with checkpoints (--resume), else start it; output to OUT/stdout.log;
# a run that finishes has its checkpoints removed (KEEP_CHECKPOINTS=1 keeps them).
run_job() {
    local out=$1 core=$2 script=$3
    shift 3
    if finished "$out"; then
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
# over the cores in CORES; refuses, before any job, a queue the machine cannot hold
# (check_budget); exits non-zero when a job failed (the others still run).
run_queue() {
    check_budget || return 1
    local -a cores
    read -r -a cores <<< "$CORES"
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
