#!/usr/bin/env bash
# One documented learning run of the main job (docs/results.md):
#
#   benchmarks/learning_run.sh SEED [MINUTES] [NAME]
#   EVAL_ONLY=1 benchmarks/learning_run.sh SEED [MINUTES] [NAME]   # evaluate a finished run again
#
# Fresh state under var/runs/NAME (default seed<SEED>): its own broker, weight store,
# checkpoints and logs. Builds (or reuses) the warm start, runs the default
# `rollway up` for MINUTES (default 30) with every component seeded by SEED, then
# measures held-out pass@1 of version 0 (the warm start) and of the last version with
# `rollway eval` on 100 held-out instances (2 samples each) of each split in EVAL_SPLITS
# (held-out behaviours with training names, and with held-out names) for each draw in
# EVAL_SEEDS (default 0 1 2), and writes `rollway report` into the run.
# The live evaluator is left out (--without evaluator): on 2 cores each of its 100-task
# evaluations takes the CPU from training for minutes, and the evaluations after the
# run measure the same versions on the same tasks.
# Extra settings for an ablation go in the environment (ROLLWAY_SECTION__KEY=value),
# e.g. ROLLWAY_TRAINER__REPLAY_KEPT_SETS=false.
set -euo pipefail
cd "$(dirname "$0")/.."

SEED=${1:?usage: benchmarks/learning_run.sh SEED [MINUTES] [NAME]}
MINUTES=${2:-30}
NAME=${3:-seed$SEED}
RUN=var/runs/$NAME
ROLLWAY=.venv/bin/rollway
EVAL_TASKS=${EVAL_TASKS:-100}
# Samples per held-out task: one sample on 100 tasks moves by up to 5 points between two
# evaluations of the same model; 2 halves that spread.
EVAL_SAMPLES=${EVAL_SAMPLES:-2}
# Held-out behaviours named from the training pool, and from the held-out name pool.
EVAL_SPLITS=${EVAL_SPLITS-heldout heldout-names}  # empty: no evaluation (a smoke run)
# Draws of held-out instances: the rise depends on the draw, so every split is measured on several.
EVAL_SEEDS=${EVAL_SEEDS:-0 1 2}
SANDBOX_PORT=${SANDBOX_PORT:-8391}
BROKER_PORT=${BROKER_PORT:-9092}  # another port lets a second run start while one evaluates

if [ -z "${EVAL_ONLY:-}" ]; then
    rm -rf "$RUN"
fi
mkdir -p "$RUN"
export ROLLWAY_SYNCER__STORE_URL="file://$PWD/$RUN/weights"
export ROLLWAY_TRAINER__CHECKPOINT_DIR="$RUN/checkpoints"
# The main job's context length (rollway up's MAIN_JOB), for the evaluations below too:
# `rollway eval` runs with the components' defaults.
export ROLLWAY_SAMPLER__MAX_MODEL_LEN=${ROLLWAY_SAMPLER__MAX_MODEL_LEN:-2048}
for section in trainer sampler feeder; do export "ROLLWAY_${section^^}__SEED=$SEED"; done

# BROKER_ARGS: extra arguments for `rollway broker start` (e.g. --insecure).
"$ROLLWAY" broker start --data-dir "$RUN/kafka" --port "$BROKER_PORT" ${BROKER_ARGS:-} | tee "$RUN/broker.txt"
# Every export it prints: the address, and the credentials of a secured broker.
eval "$(grep '^export ' "$RUN/broker.txt")"
sandbox_pid=
cleanup() {
    [ -n "$sandbox_pid" ] && kill "$sandbox_pid" 2>/dev/null || true
    "$ROLLWAY" broker stop --data-dir "$RUN/kafka" >/dev/null 2>&1 || true
}
trap cleanup EXIT

if [ -z "${EVAL_ONLY:-}" ]; then
    echo "== rollway up --minutes $MINUTES (seed $SEED) =="
    started=$(date +%s)
    "$ROLLWAY" up --no-tui --minutes "$MINUTES" --without evaluator --log-dir "$RUN/logs" | tee "$RUN/up.txt"
    echo "up took $(( $(date +%s) - started )) s"
fi

echo "== held-out pass@1: version 0 and the last version =="
ROLLWAY_SANDBOX__PORT=$SANDBOX_PORT ROLLWAY_SANDBOX__WORKSPACE_ROOT="$RUN/eval-workspaces" \
    "$ROLLWAY" sandbox >"$RUN/logs/eval-sandbox.log" 2>&1 &
sandbox_pid=$!
for _ in $(seq 120); do  # the sandbox's self-check takes a few seconds
    curl -fsS "http://127.0.0.1:$SANDBOX_PORT/health" >/dev/null 2>&1 && break
    kill -0 "$sandbox_pid" 2>/dev/null || { echo "sandbox exited; see $RUN/logs/eval-sandbox.log" >&2; exit 1; }
    sleep 0.5
done
for split in $EVAL_SPLITS; do
    for eval_seed in $EVAL_SEEDS; do
        eval_args=(--split "$split" --max-tasks "$EVAL_TASKS" --samples "$EVAL_SAMPLES" --seed "$eval_seed"
                   --sandbox-url "http://127.0.0.1:$SANDBOX_PORT" --json)
        "$ROLLWAY" eval --version 0 "${eval_args[@]}" >"$RUN/eval-$split-s$eval_seed-v0.json"
        "$ROLLWAY" eval --version latest "${eval_args[@]}" >"$RUN/eval-$split-s$eval_seed-last.json"
    done
done
"$ROLLWAY" report --out "$RUN/report" | tail -3
grep -h "learning signal\|trained groups per minute" "$RUN/report/summary.md" || true
# The run's rewards, for benchmarks/selection_replay.py (selection policies on its measured solve rates).
.venv/bin/python benchmarks/selection_replay.py dump "$RUN/rewards.jsonl"
.venv/bin/python - "$RUN" "$EVAL_SPLITS" "$EVAL_SEEDS" <<'EOF'
import json, sys
run, splits, seeds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
for split in splits:
    rises = []
    for seed in seeds:
        v0, last = (json.load(open(f"{run}/eval-{split}-s{seed}-{tag}.json"))["result"] for tag in ("v0", "last"))
        rises.append(last["pass_at_1"] - v0["pass_at_1"])
        for result, label in ((v0, "warm start"), (last, "after RL")):
            print(json.dumps({"run": run, "split": split, "eval_seed": int(seed), "model": label,
                              **{k: result.get(k) for k in ("weight_version", "pass_at_1", "per_kind", "tasks",
                                                            "samples", "seconds")}}))
    print(json.dumps({"run": run, "split": split, "rise_per_draw": [round(r, 3) for r in rises],
                      "mean_rise": round(sum(rises) / len(rises), 3), "min_rise": round(min(rises), 3)}))
EOF
