"""Weight sync benchmark: how big are the deltas, how fast is the codec, how long the pause.

A Qwen2-style model (random init, no downloads; ~125M parameters by default) is trained
for a few real AdamW steps from fp32 master weights at two learning rates; the bf16
weights before and after the last step make one delta. A third case changes 1% of the
bf16 values (random mantissa bits). For each case, side by side in one run:

* changed values, and the stored delta (XOR, byte planes where they help, zstd) as a
  fraction of the full bf16 model; a keyframe (full copy, compressed) for reference;
* a sparse index+value encoding of the same delta (int32 index + bf16 value per
  changed element), raw and zstd-compressed (gap-coded indices);
* encode and decode throughput on ONE thread, everything the publisher / subscriber
  do per byte (checksums, XOR, planes, zstd), next to a plain single-threaded memory
  copy of the same bytes measured in the same run;
* the in-place apply pause into the bf16 torch model (``syncer.apply``): the changed
  tensors, and the full state.

    .venv/bin/python benchmarks/weight_sync.py            # ~125M params, a few minutes
    .venv/bin/python benchmarks/weight_sync.py --small    # seconds, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from syncer.apply import apply_to_module
from syncer.bits import bits_view
from syncer.config import SyncerConfig
from syncer.hashing import checksum
from syncer.manifest import ChunkRef
from syncer.tensor_codec import allocate, decode_into, encode_planned_chunk, plan_tensor, verify_tensor

CHUNK_BYTES = SyncerConfig().chunk_bytes


@dataclass
class Row:
    case: str
    changed: float
    delta_frac: float
    keyframe_frac: float
    sparse_raw_frac: float
    sparse_zstd_frac: float
    planes: str
    enc_gbs: float
    dec_gbs: float
    memcpy_gbs: float
    pause_changed_ms: float
    pause_full_ms: float


def build_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=512, tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


def bf16_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def train_steps(master_state, args, lr: float) -> tuple[dict, dict]:
    """bf16 weights before and after the last of ``args.steps`` AdamW steps at ``lr``."""
    model = build_model(args)
    model.load_state_dict(master_state)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    before = None
    for _ in range(args.steps):
        before = bf16_state(model)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = bf16_state(model)
    del model, opt
    gc.collect()
    return before, after


def one_percent_change(base: dict[str, torch.Tensor], fraction: float = 0.01) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(2)
    new = {}
    for name, t in base.items():
        out = t.clone()
        bits = bits_view(out)
        idx = rng.choice(bits.size, size=max(1, int(bits.size * fraction)), replace=False)
        bits[idx] ^= rng.integers(1, 128, size=idx.size, dtype=np.uint16)  # mantissa bits
        new[name] = out
    return new


def encode_all(new: dict, base: dict | None, level: int) -> tuple[dict, dict, float]:
    """(entries, payloads, seconds) on one thread, everything the publisher does."""
    entries, payloads = {}, {}
    t0 = time.perf_counter()
    for name, t in new.items():
        plan = plan_tensor(name, t, None if base is None else base[name],
                           chunk_bytes=CHUNK_BYTES, level=level, byte_planes="auto")
        chunks, blobs = [], []
        for i, (start, count) in enumerate(plan.ranges):
            payload = encode_planned_chunk(plan, start, count, level)
            chunks.append(ChunkRef(key=f"{name}#{i}", start=start, count=count, raw_bytes=count * 2,
                                   stored_bytes=len(payload), checksum=checksum(payload)))
            blobs.append(payload)
        entries[name] = plan.entry(chunks)
        payloads[name] = blobs
    return entries, payloads, time.perf_counter() - t0


def decode_all(entries: dict, payloads: dict, base: dict | None) -> tuple[dict, float]:
    out = {}
    t0 = time.perf_counter()
    for name, entry in entries.items():
        b = None if base is None else base[name]
        if entry.encoding == "same":
            out[name] = b
            continue
        t = allocate(entry)
        for ref, payload in zip(entry.chunks, payloads[name]):
            decode_into(entry, ref, payload, t, b)
        verify_tensor(entry, t)
        out[name] = t
    return out, time.perf_counter() - t0


def memcpy_seconds(state: dict) -> float:
    arrays = [bits_view(t) for t in state.values()]
    dst = [np.empty_like(a) for a in arrays]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for d, a in zip(dst, arrays):
            np.copyto(d, a)
        best = min(best, time.perf_counter() - t0)
    return best


def sparse_sizes(new: dict, base: dict, level: int) -> tuple[int, int, int]:
    """(changed elements, raw bytes, zstd bytes) of int32 index + bf16 value per change."""
    zc = zstandard.ZstdCompressor(level=level)
    nnz = raw = packed = 0
    for name in new:
        a, b = bits_view(new[name]), bits_view(base[name])
        idx = np.flatnonzero(a != b)
        nnz += idx.size
        raw += idx.size * (4 + 2)
        if idx.size:
            gaps = np.diff(idx, prepend=0).astype(np.uint32)  # gap coding helps zstd
            packed += len(zc.compress(gaps.tobytes())) + len(zc.compress(a[idx].tobytes()))
    return nnz, raw, packed


def pause_ms(module, tensors: dict) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        apply_to_module(module, tensors)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run_case(name: str, base: dict, new: dict, module, args, keyframe_frac: float) -> Row:
    total = sum(t.numel() * t.element_size() for t in new.values())
    entries, payloads, enc_s = encode_all(new, base, args.level)
    decoded, dec_s = decode_all(entries, payloads, base)
    for k in new:  # the benchmark checks what it measures
        assert np.array_equal(bits_view(decoded[k]), bits_view(new[k])), k
    stored = sum(e.stored_bytes for e in entries.values())
    nnz, sparse_raw, sparse_zstd = sparse_sizes(new, base, args.level)
    coded = [e for e in entries.values() if e.encoding == "xor"]
    changed_tensors = {k: new[k] for k, e in entries.items() if e.encoding != "same"}
    return Row(
        case=name,
        changed=nnz / (total // 2),
        delta_frac=stored / total,
        keyframe_frac=keyframe_frac,
        sparse_raw_frac=sparse_raw / total,
        sparse_zstd_frac=sparse_zstd / total,
        planes=f"{sum(e.byte_planes for e in coded)}/{len(coded)}",
        enc_gbs=total / enc_s / 1e9,
        dec_gbs=total / dec_s / 1e9,
        memcpy_gbs=total / memcpy_seconds(new) / 1e9,
        pause_changed_ms=pause_ms(module, changed_tensors),
        pause_full_ms=pause_ms(module, new),
    )


def end_to_end(base: dict, new: dict, module, threads: int) -> dict[str, float]:
    """Publish base (keyframe) and new (delta) through a local folder store, then a
    subscriber at base takes the delta: wall times of each stage."""
    import asyncio
    import tempfile

    from syncer.apply import ModuleTarget
    from syncer.publisher import WeightPublisher
    from syncer.store import LocalStore
    from syncer.subscriber import WeightSubscriber

    async def go() -> dict[str, float]:
        cfg = SyncerConfig(zstd_threads=threads, max_concurrency=2 * threads)
        with tempfile.TemporaryDirectory(prefix="rollway-bench-") as root:
            store = LocalStore(root)
            pub = WeightPublisher(cfg, "bench", store)
            t0 = time.perf_counter()
            await pub.publish(1, base)
            t1 = time.perf_counter()
            await pub.publish(2, new)
            t2 = time.perf_counter()
            sub = WeightSubscriber(cfg, "bench", store, ModuleTarget(module))
            await sub.update_to(1)
            t3 = time.perf_counter()
            await sub.update_to(2)
            t4 = time.perf_counter()
            assert sub.last_path == "delta v1->v2"
            pub.close()
            sub.close()
            return {"publish keyframe s": t1 - t0, "publish delta s": t2 - t1,
                    "subscriber keyframe path s": t3 - t2, "subscriber delta update s": t4 - t3,
                    "of which pause ms": sub.last_pause_ms}

    return asyncio.run(go())


def print_table(rows: list[Row], params: int, total: int, args) -> None:
    print()
    print(f"model: Qwen2-style, {params / 1e6:.1f}M params, bf16 {total / 1e6:.1f} MB; "
          f"zstd level {args.level}, chunks {CHUNK_BYTES >> 20} MiB; torch threads {torch.get_num_threads()}")
    print("sizes are % of the full bf16 model; GB/s are raw model bytes per second on ONE thread")
    header = ("case", "changed", "delta", "keyframe", "sparse raw", "sparse zstd", "planes",
              "enc GB/s", "dec GB/s", "memcpy GB/s", "enc/copy", "dec/copy", "pause chg ms", "pause full ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        cells = (
            r.case, f"{100 * r.changed:.3f}%", f"{100 * r.delta_frac:.3f}%", f"{100 * r.keyframe_frac:.1f}%",
            f"{100 * r.sparse_raw_frac:.3f}%", f"{100 * r.sparse_zstd_frac:.3f}%", r.planes,
            f"{r.enc_gbs:.3f}", f"{r.dec_gbs:.3f}", f"{r.memcpy_gbs:.2f}",
            f"{r.enc_gbs / r.memcpy_gbs:.3f}", f"{r.dec_gbs / r.memcpy_gbs:.3f}",
            f"{r.pause_changed_ms:.1f}", f"{r.pause_full_ms:.1f}",
        )
        print("| " + " | ".join(cells) + " |")


def parser() -> argparse.ArgumentParser:
    """The arguments, model shape included (``parser().parse_args([])``: the ~125M model;
    benchmarks/sampler_overhead.py builds the same one)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="AdamW steps per learning rate (delta = last step)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--level", type=int, default=SyncerConfig().zstd_level, help="zstd level (default: the config's)")
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--threads", type=int, default=2, help="worker threads for the end-to-end run")
    p.add_argument("--small", action="store_true", help="a tiny model: a smoke run in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.small:
        args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 512, 64, 128, 2, 2, 1
        args.seq = 16

    t_start = time.perf_counter()
    master = build_model(args)
    params = sum(p.numel() for p in master.parameters())
    master_state = {k: v.clone() for k, v in master.state_dict().items()}
    module = master.to(torch.bfloat16).eval()  # the "engine" the pauses are measured on
    base0 = bf16_state(module)
    total = sum(t.numel() * t.element_size() for t in base0.values())
    print(f"built {params / 1e6:.1f}M-param model in {time.perf_counter() - t_start:.1f}s", flush=True)

    keyframe_entries, _, _ = encode_all(base0, None, args.level)
    keyframe_frac = sum(e.stored_bytes for e in keyframe_entries.values()) / total
    del keyframe_entries

    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        t0 = time.perf_counter()
        before, after = train_steps(master_state, args, lr)
        print(f"lr {lr:g}: {args.steps} AdamW steps in {time.perf_counter() - t0:.1f}s", flush=True)
        rows.append(run_case(f"AdamW lr={lr:g}", before, after, module, args, keyframe_frac))
        if lr == max(float(x) for x in args.lrs.split(",")):
            e2e = end_to_end(before, after, module, args.threads)
        del before, after
        gc.collect()
    rows.append(run_case("1% values changed", base0, one_percent_change(base0), module, args, keyframe_frac))
    print_table(rows, params, total, args)
    print(f"\nend to end through a local folder store, {args.threads} threads, largest-lr delta "
          f"(level {SyncerConfig().zstd_level}, fsync on):")
    print("| " + " | ".join(e2e) + " |")
    print("|" + "|".join("---" for _ in e2e) + "|")
    print("| " + " | ".join(f"{v:.2f}" if not k.endswith("ms") else f"{v:.1f}" for k, v in e2e.items()) + " |")
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
