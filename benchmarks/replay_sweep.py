"""Re-train a finished run's logged steps under other trainer settings, offline.

The step log names the exact groups every step trained on, so a run's data can be
trained again with another learning rate, advantage normalisation, optimizer split...
in about a second per step, without sampling or grading anything. After every
``--every`` steps each variant is scored on held-out tasks by a cheap, deterministic
proxy (teacher forcing, no sampling):

* ``greedy``: fraction of held-out reference transcripts whose every policy token is
  the model's argmax (the greedy agent would write exactly the reference solution);
* ``p_ref``: mean probability of the whole reference transcript at T = 1.

Both are lower bounds of pass@1 (other correct solutions exist), good for comparing
settings on the same data, not a substitute for ``rollway eval``. Caveat: the groups
were sampled by the run's own policy, so for any other setting they are off-policy
(importance sampling corrects the log-probs, not the choice of samples).

    # the run's broker must be up: rollway broker start --data-dir var/runs/seed0/kafka
    .venv/bin/python benchmarks/replay_sweep.py --model var/models/tiny \\
        '{"learning_rate": 1e-3, "muon_learning_rate": 1e-3}' \\
        '{"learning_rate": 2e-4, "muon_learning_rate": 2e-4}'

Prints one table row per variant and checkpoint (docs/results.md has a sweep).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys


def proxy_scorer(model_dir: str, tasks: int, seed: int):
    import torch
    from transformers import AutoTokenizer

    from tasks.family import generate
    from trainer.sft import _batch, render_transcript

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    specs = generate("heldout", tasks, seed=seed)
    examples = [render_transcript(s, tokenizer) for s in specs]
    kinds = [s.metadata["kind"] for s in specs]

    def score(model) -> dict[str, float]:
        was_training = model.training
        model.eval()
        greedy, p_ref = [], []
        with torch.no_grad():
            for i in range(0, len(examples), 50):
                ids, mask = _batch(examples[i: i + 50], tokenizer.pad_token_id)
                logits = model(input_ids=ids).logits[:, :-1].float()
                targets, weights = ids[:, 1:], mask[:, 1:]
                logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
                greedy += ((logits.argmax(-1) == targets) | (weights == 0)).all(-1).tolist()
                p_ref += [math.exp(float(x)) for x in (logp * weights).sum(-1)]
        model.train(was_training)
        out = {"greedy": sum(greedy) / len(greedy), "p_ref": sum(p_ref) / len(p_ref)}
        for kind in sorted(set(kinds)):
            rows = [g for g, k in zip(greedy, kinds) if k == kind]
            out[f"greedy_{kind}"] = sum(rows) / len(rows)
        return out

    return score


async def sweep(variants: list[dict], model_dir: str, every: int, tasks: int, seed: int) -> list[dict]:
    import msgspec

    from rollway.config import load_config
    from trainer.core import TrainCore
    from trainer.replay import replay_steps, restore_checkpoint
    from trainer.steplog import read_step_log

    cfg = load_config()
    steps = await read_step_log(cfg.kafka)
    if not steps:
        raise SystemExit("replay_sweep: the train-step log is empty (is the run's broker up?)")
    score = proxy_scorer(model_dir, tasks, seed)
    rows: list[dict] = []
    for variant in variants:
        core = TrainCore(msgspec.structs.replace(cfg.trainer, model_path=model_dir, **variant))
        restore_checkpoint(core, None)
        rows.append({"variant": variant, "step": 0, **score(core.model)})

        def on_step(result, row, variant=variant, core=core):
            if row.step % every == 0 or row.step == max(steps):
                rows.append({"variant": variant, "step": row.step, **score(core.model)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

        await replay_steps(cfg.kafka, core, steps, max(steps), fail_on_mismatch=False, on_step=on_step)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="trainer settings as JSON objects")
    parser.add_argument("--model", required=True, help="the run's initial model folder")
    parser.add_argument("--every", type=int, default=5, help="score after every N steps")
    parser.add_argument("--tasks", type=int, default=200, help="held-out tasks in the proxy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out instances")
    args = parser.parse_args()
    from rollway.logging import configure_logging

    configure_logging("replay-sweep", level="warning", stream=sys.stderr)  # the table alone on stdout
    rows = asyncio.run(sweep([json.loads(v) for v in args.variants], args.model, args.every, args.tasks, args.seed))
    kinds = sorted(k[len("greedy_"):] for k in rows[0] if k.startswith("greedy_"))
    print(f"{'variant':<60} {'step':>4} {'greedy':>7} {'p_ref':>6} " + " ".join(f"{k:>6}" for k in kinds))
    for r in rows:
        print(f"{json.dumps(r['variant']):<60} {r['step']:>4} {r['greedy']:>7.3f} {r['p_ref']:>6.3f} "
              + " ".join(f"{r['greedy_' + k]:>6.2f}" for k in kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
