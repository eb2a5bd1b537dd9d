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
# `rollway eval` on 100 held-out instances (2 samples each), and writes `rollway report` into the run.
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
SANDBOX_PORT=${SANDBOX_PORT:-8391}
BROKER_PORT=${BROKER_PORT:-9092}  # another port lets a second run start while one evaluates

if [ -z "${EVAL_ONLY:-}" ]; then
    rm -rf "$RUN"
fi
mkdir -p "$RUN"
export ROLLWAY_SYNCER__STORE_URL="file://$PWD/$RUN/weights"
export ROLLWAY_TRAINER__CHECKPOINT_DIR="$RUN/checkpoints"
for section in trainer sampler feeder; do export "ROLLWAY_${section^^}__SEED=$SEED"; done

"$ROLLWAY" broker start --data-dir "$RUN/kafka" --port "$BROKER_PORT" | tee "$RUN/broker.txt"
eval "$(grep '^export KAFKA_BOOTSTRAP_SERVERS=' "$RUN/broker.txt")"
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
eval_args=(--split heldout --max-tasks "$EVAL_TASKS" --samples "$EVAL_SAMPLES" --seed 0 --sandbox-url "http://127.0.0.1:$SANDBOX_PORT" --json)
"$ROLLWAY" eval --version 0 "${eval_args[@]}" >"$RUN/eval-v0.json"
"$ROLLWAY" eval --version latest "${eval_args[@]}" >"$RUN/eval-last.json"
"$ROLLWAY" report --out "$RUN/report" | tail -3
.venv/bin/python - "$RUN" <<'EOF'
import json, sys
run = sys.argv[1]
for tag, label in (("v0", "warm start"), ("last", "after RL")):
    result = json.load(open(f"{run}/eval-{tag}.json"))["result"]
    print(json.dumps({"run": run, "model": label, **{k: result.get(k) for k in
                                                      ("weight_version", "pass_at_1", "per_kind", "tasks", "samples", "seconds")}}))
EOF
