"""Activation memory per rank with recompute = full / selective vs none (model.recompute).

    python benchmarks/bench_recompute.py                       # FP4 MoEResQ (experts+attention), 4 layers
    python benchmarks/bench_recompute.py --seq-len 1024 --layers 8

One rank's forward + backward of one micro-batch (a single process is a mesh of one; under pp a
rank runs its chunks' layers the same way). Two measurements, each mode in a fresh process:

- ``held``: bytes of the tensors the forward created that are alive when it returns, i.e. what the
  backward starts from (`recompute.held_activation_bytes`, deterministic);
- ``peak ΔRSS``: the process's peak resident memory during forward + backward minus its RSS before
  (sampled every 1 ms by a thread), after a warm-up step. The children run with glibc's
  ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so every tensor above it is its own mapping, returned
  to the OS when freed: RSS then follows the live tensors instead of what the allocator keeps.

Also the gradients of each mode against none (bitwise) and the step time ratio (for information;
recompute re-runs forward work in backward). Ratios vs none are printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

MODES = {"none": {}, "full": {"recompute": "full"}, "full_every_2": {"recompute": "full", "recompute_num_layers": 2},
         "selective": {"recompute": "selective"},
         "selective_moe": {"recompute": "selective", "recompute_modules": ["moe", "attention"]}}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(mode: str, args) -> dict:
    import torch

    from megatron_fp4.config import Config
    from megatron_fp4.model.recompute import held_activation_bytes
    from megatron_fp4.model.transformer import build_model, lm_loss

    torch.set_num_threads(args.threads)
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim = args.layers, args.hidden, 8, 4, 32
    m.moe_ffn_hidden_size, m.vocab_size, m.max_seq_len = args.hidden, 256, args.seq_len
    cfg.fp4.scope = "experts+attention"
    for key, value in MODES[mode].items():
        setattr(m, key, value)
    cfg.validate()
    model = build_model(cfg, seed=0).train()
    tokens = torch.randint(0, m.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        return lm_loss(model(tokens).logits[:, :-1], tokens[:, 1:])

    with model.numerics.training_step(0):  # warm-up: first-call allocations and kernel caches
        step().backward()
    model.zero_grad(set_to_none=True)
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    with model.numerics.training_step(1):
        loss, held = held_activation_bytes(step)
        loss.backward()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    torch.save(grads, args.grads_path(mode))
    return {"held": held, "peak_rss": max(peak[0], _rss()) - before, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tmp", default="/tmp/bench_recompute")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layers < 1 or args.hidden % 32 or args.seq_len < 2 or args.batch < 1 or args.threads < 1:
        sys.exit("bench_recompute: need --layers >= 1, --hidden a multiple of 32, --seq-len >= 2, --batch >= 1, "
                 "--threads >= 1")
    args.grads_path = lambda mode: os.path.join(args.tmp, f"grads_{mode}.pt")
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    import torch

    os.makedirs(args.tmp, exist_ok=True)
    forwarded = sys.argv[1:]
    results = {}
    for mode in MODES:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        out = subprocess.run([sys.executable, __file__, *forwarded, "--child", mode], check=True,
                             capture_output=True, text=True, env=env)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    ref = torch.load(args.grads_path("none"), weights_only=True)
    print(f"model: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq_len}, "
          f"FP4 fp4_resq (experts+attention)")
    print(f"{'mode':<14} {'held MB':>9} {'peak dRSS MB':>13} {'step s':>8}  grads == none")
    for mode, r in results.items():
        same = torch.equal(torch.load(args.grads_path(mode), weights_only=True), ref)
        print(f"{mode:<14} {r['held'] / 2**20:9.1f} {r['peak_rss'] / 2**20:13.1f} {r['seconds']:8.2f}  {same}")
    base = results["none"]
    print("ratios vs none (held activation bytes | peak ΔRSS | step time):")
    for mode, r in results.items():
        if mode != "none":
            print(f"  {mode:<14} {r['held'] / base['held']:.3f} | {r['peak_rss'] / max(base['peak_rss'], 1):.3f} | "
                  f"{r['seconds'] / base['seconds']:.2f}")


if __name__ == "__main__":
    main()
