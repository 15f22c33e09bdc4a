"""Checkpoint conversion: ours <-> Hugging Face Qwen3-MoE safetensors, and inspection.

    python tools/convert_checkpoint.py inspect outputs/tiny_moe/checkpoints
    python tools/convert_checkpoint.py to-hf   outputs/tiny_moe/checkpoints  hf_out/ [--dtype bf16]
    python tools/convert_checkpoint.py from-hf hf_out/  converted/           [--set fp4.scope=experts ...]

`to-hf` reads a single-process ("single"/"weights") checkpoint or a sharded DCP one (any parallel
layout; expert and pipeline shards are gathered) and writes `config.json` + `model.safetensors`.
`from-hf` writes a weights-only checkpoint (step 0) plus its `config.yaml`; train from it with
``megatron-fp4-train --config converted/step_00000000/config.yaml --set checkpoint.load=converted``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from megatron_fp4.config import apply_overrides, config_from_dict
from megatron_fp4.model import build_model
from megatron_fp4.training import checkpoint as ckpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model_state(path: str) -> tuple[dict, dict]:
    """(model state dict with global names, meta) of any of our checkpoint kinds."""
    step_dir = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(step_dir)
    if meta["kind"] in ("single", "weights"):
        state, meta = ckpt.load_checkpoint(step_dir)
        return state["model"], meta
    from megatron_fp4.training.dist_checkpoint import load_full_model_state

    return load_full_model_state(step_dir), meta


def cmd_inspect(args) -> int:
    state, meta = load_model_state(args.checkpoint)
    cfg = meta["config"]
    print(f"checkpoint: {ckpt.resolve_checkpoint(args.checkpoint)}")
    print(f"kind: {meta['kind']}  step: {meta['step']}  format: {meta['format_version']}")
    print(f"model: {cfg['model']['num_layers']} layers, hidden {cfg['model']['hidden_size']}, "
          f"{cfg['model']['num_experts']} experts top-{cfg['model']['top_k']}; fp4: {cfg['fp4']}")
    print(f"parallel layout it was saved from: {cfg['parallel']}")
    total = sum(t.numel() for t in state.values())
    print(f"tensors: {len(state)}  parameters: {total:,}")
    return 0


def cmd_to_hf(args) -> int:
    from megatron_fp4.integrations.hf import save_hf_checkpoint

    state, meta = load_model_state(args.checkpoint)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg)
    model.load_state_dict(state)
    out = save_hf_checkpoint(model, cfg, args.out, dtype=DTYPES[args.dtype], overwrite=args.overwrite)
    print(f"wrote {out} (config.json + model.safetensors, {args.dtype})")
    return 0


def cmd_from_hf(args) -> int:
    from megatron_fp4.integrations.hf import from_hf_state_dict, load_hf_checkpoint

    model_cfg, hf_state = load_hf_checkpoint(args.hf)
    data = {"model": {k: getattr(model_cfg, k) for k in model_cfg.__dataclass_fields__}}
    cfg = config_from_dict(apply_overrides(data, args.overrides))
    cfg.validate()
    model = build_model(cfg)
    from_hf_state_dict(model, hf_state)
    out = ckpt.save_checkpoint(args.out, 0, {"model": model.state_dict()}, cfg.to_dict(), kind="weights")
    print(f"wrote {out} (weights-only); train with: megatron-fp4-train --config {out / 'config.yaml'} "
          f"--set checkpoint.load={out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print what a checkpoint holds")
    p.add_argument("checkpoint")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("to-hf", help="our checkpoint -> HF Qwen3-MoE safetensors")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_to_hf)
    p = sub.add_parser("from-hf", help="HF Qwen3-MoE safetensors -> our weights-only checkpoint")
    p.add_argument("hf")
    p.add_argument("out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(fn=cmd_from_hf)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
