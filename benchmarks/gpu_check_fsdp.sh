#!/usr/bin/env bash
# The sharded trainer (issue #28) on CUDA with NCCL: the prepared device check.
#
#   bash benchmarks/gpu_check_fsdp.sh            # results under $OUT (default /tmp/gpu_check_fsdp)
#
# What it checks, on the repository's tiny model and 4 sampled groups (2 steps):
#   1. the sharded trainer at 1 rank (NCCL, mesh of 1) against the single-process trainer
#      on the same GPU: bit-identical weight hashes expected (as measured on CPU/gloo);
#   2. with >= 2 GPUs: 2 ranks (NCCL, one GPU each) twice: bit-identical to each other,
#      and the 2-rank step against 1 process within the CPU-stated tolerances;
#   3. with >= 2 GPUs: a DCP checkpoint written at 2 ranks resumes at 2 ranks bit-exact.
#   4. FSDP2 CPU offload (trainer.fsdp.cpu_offload, CPUOffloadPolicy; NCCL + gloo for the
#      CPU shards): 1 rank trains the 2 steps (weights against the non-offloaded 1-rank run
#      and its peak CUDA memory against that run's, both informational: the optimizer
#      steps on the CPU, so bits may differ); with >= 2 GPUs, 2 offloaded ranks with a DCP
#      checkpoint resume bit-exact.
# NCCL cannot put two ranks on one GPU, so a 1-GPU machine runs check 1 only (said in
# the summary). Prints one JSON summary line at the end; exits non-zero on a failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp/gpu_check_fsdp}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" OMP_NUM_THREADS=1

NGPU=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
echo "gpus: $NGPU"
[ "$NGPU" -ge 1 ] || { echo "no CUDA device"; exit 2; }

# The tiny model, 4 sampled groups, and the single-process reference on the GPU.
$PY - "$OUT" <<'EOF'
import json, pickle, sys
from pathlib import Path
import torch
from sampler.tiny_model import tiny_model_dir
from tests.synthetic import groups_from_sampled, load_tiny, make_task_groups
from trainer.config import TrainerConfig
from trainer.core import TrainCore
out = Path(sys.argv[1])
path = str(tiny_model_dir())
model, tok = load_tiny(path)
groups = groups_from_sampled(make_task_groups(model, tok, 4, group_size=4, max_new_tokens=10, env_after=4, seed=3))
(out / "groups.pkl").write_bytes(pickle.dumps(groups))
core = TrainCore(TrainerConfig(model_path=path, learning_rate=1e-3, muon_learning_rate=1e-3, max_staleness=100,
                               micro_batch_tokens=256, num_threads=1, device="cuda"))
hashes = [core.train_step([groups[i] for i in b]).weights_hash for b in ([0, 1], [2, 3])]
params = {n: p.detach().cpu().clone() for n, p in core.model.named_parameters()}
torch.save({"hashes": hashes, "params": params}, out / "single.pt")
offload = {"config": {"fsdp": {"cpu_offload": True}}}
for name, extra in (("ws", {}), ("ckpt", {"checkpoint_after": 1, "checkpoint_dir": str(out / "ckpt")}),
                    ("ws-off", offload),
                    ("ckpt-off", dict(offload, checkpoint_after=1, checkpoint_dir=str(out / "ckpt-off")))):
    args = dict(model_path=path, groups=str(out / "groups.pkl"), batches=[[0, 1], [2, 3]], device="cuda", **extra)
    (out / f"{name}.json").write_text(json.dumps(args))
print("reference hashes", hashes)
EOF

run() {  # run NPROC SCENARIO ARGS OUTFILE
  local args="$OUT/$(basename "$4" .pt)-args.json"
  $PY -c "import json,sys; a=json.load(open(sys.argv[1])); a['out']=sys.argv[2]; json.dump(a, open(sys.argv[3],'w'))" "$3" "$4" "$args"
  $PY -m torch.distributed.run --standalone --nproc-per-node "$1" tests/fsdp_worker.py "$2" "$args" > "$4.log" 2>&1 \
    || { echo "FAILED: $2 on $1 ranks (log: $4.log)"; tail -40 "$4.log"; exit 1; }
}

run 1 train "$OUT/ws.json" "$OUT/ws1.pt"
run 1 train "$OUT/ws-off.json" "$OUT/ws1off.pt"
if [ "$NGPU" -ge 2 ]; then
  rm -rf "$OUT/ckpt" "$OUT/ckpt-off"
  run 2 train "$OUT/ckpt.json" "$OUT/ws2a.pt"
  run 2 train "$OUT/ws.json" "$OUT/ws2b.pt"
  run 2 resume "$OUT/ckpt.json" "$OUT/resume2.pt"
  run 2 train "$OUT/ckpt-off.json" "$OUT/ws2off.pt"
  run 2 resume "$OUT/ckpt-off.json" "$OUT/resume2off.pt"
fi

$PY - "$OUT" "$NGPU" <<'EOF'
import json, sys
from pathlib import Path
import torch
out, ngpu = Path(sys.argv[1]), int(sys.argv[2])
load = lambda n: torch.load(out / n, weights_only=False)
single, ws1, off1 = load("single.pt"), load("ws1.pt"), load("ws1off.pt")
maxdiff = lambda a, b: max(float((a[n] - b[n]).abs().max()) for n in b)
summary = {"gpus": ngpu, "device": torch.cuda.get_device_name(0),
           "ws1_bit_identical_to_single": ws1["hashes"] == single["hashes"],
           "ws1_offload_trained_steps": len(off1["hashes"]),
           "ws1_offload_bit_identical_to_ws1": off1["hashes"] == ws1["hashes"],
           "ws1_offload_max_abs_weight_diff_after_2_steps": maxdiff(off1["params"][1], ws1["params"][1]),
           "ws1_cuda_peak_mb": ws1["cuda_peak_bytes"] / 2**20,
           "ws1_offload_cuda_peak_mb": off1["cuda_peak_bytes"] / 2**20}
ok = summary["ws1_bit_identical_to_single"] and summary["ws1_offload_trained_steps"] == 2
if ngpu >= 2:
    a, b, r = load("ws2a.pt"), load("ws2b.pt"), load("resume2.pt")
    w2 = a["params"][1]
    summary.update(
        ws2_runs_bit_identical=a["hashes"] == b["hashes"],
        ws2_vs_single_max_abs_weight_diff_after_2_steps=max(
            float((w2[n] - single["params"][n]).abs().max()) for n in single["params"]),
        ws2_resume_bit_exact=(r["restored"] == 1 and r["restored_hash"] == a["hashes"][0]
                              and r["hashes"] == a["hashes"][1:]))
    o, ro = load("ws2off.pt"), load("resume2off.pt")
    summary.update(
        ws2_offload_resume_bit_exact=(ro["restored"] == 1 and ro["restored_hash"] == o["hashes"][0]
                                      and ro["hashes"] == o["hashes"][1:]),
        ws2_offload_vs_ws2_max_abs_weight_diff_after_2_steps=maxdiff(o["params"][1], w2),
        ws2_cuda_peak_mb_rank0=a["cuda_peak_bytes"] / 2**20, ws2_offload_cuda_peak_mb_rank0=o["cuda_peak_bytes"] / 2**20)
    ok = (ok and summary["ws2_runs_bit_identical"] and summary["ws2_resume_bit_exact"]
          and summary["ws2_offload_resume_bit_exact"])
else:
    summary["not_checked"] = "2-rank NCCL needs 2 GPUs (NCCL refuses two ranks on one device)"
print(json.dumps(summary))
(out / "summary.json").write_text(json.dumps(summary))
sys.exit(0 if ok else 1)
EOF
