"""Checkpoint conversion: ours <-> Hugging Face Qwen3-MoE safetensors, and inspection.

    python tools/convert_checkpoint.py inspect outputs/tiny_moe/checkpoints
    python tools/convert_checkpoint.py to-hf   outputs/tiny_moe/checkpoints  hf_out/ [--dtype bf16] [--no-quant-config]
    python tools/convert_checkpoint.py from-hf hf_out/  converted/           [--set fp4.scope=experts ...]

`to-hf` reads a single-process ("single"/"weights") checkpoint or a sharded DCP one (any parallel
layout; expert and pipeline shards are gathered) and writes `config.json` + `model.safetensors`;
config.json carries the checkpoint's FP4 recipe as `quantization_config` (`quant_method`
"megatron_fp4": vLLM with this package installed serves it with MoEResQ, docs/vllm.md;
transformers ignores the block), `--no-quant-config` leaves it out.
`from-hf` writes a weights-only checkpoint (step 0) plus its `config.yaml`; train from it with
``megatron-fp4-train --config converted/step_00000000/config.yaml --set checkpoint.load=converted``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_fp4.config import ConfigError, apply_overrides, config_from_dict
from megatron_fp4.config_validate import check_model_limits
from megatron_fp4.model import build_model
from megatron_fp4.training import checkpoint as ckpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model_state(path: str) -> tuple[dict, dict, Path]:
    """(model state dict with global names, meta, step dir) of any of our checkpoint kinds; for a
    root, the newest intact step (damaged ones are skipped with a warning)."""
    def load_one(step_dir: Path):
        meta = ckpt.read_meta(step_dir)
        kind = meta.get("kind")
        if kind in ("single", "weights"):
            state, meta = ckpt.load_step(step_dir)
            if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
                raise ckpt.CheckpointError(f"{step_dir / ckpt.STATE_FILE} has no 'model' state dict; it was not "
                                           f"written by megatron-fp4")
            ckpt.check_state_fits(model_shapes(meta, step_dir), state["model"], step_dir)
            return state["model"], meta, step_dir
        if kind == "dcp":
            from megatron_fp4.training.dist_checkpoint import read_full_model_state

            return read_full_model_state(step_dir, meta, model_shapes(meta, step_dir)), meta, step_dir
        raise ckpt.CheckpointError(f"{step_dir / ckpt.META_FILE}: unknown checkpoint kind {kind!r} (expected "
                                   f"'single', 'weights' or 'dcp')")

    return ckpt.with_fallback(path, load_one)


def saved_config(meta: dict, step_dir: Path) -> dict:
    """The config section of meta.json, with the sections `inspect` and `to-hf` read checked."""
    cfg = meta.get("config")
    missing = [key for key in ("model",) if not isinstance(cfg, dict) or not isinstance(cfg.get(key), dict)]
    if missing:
        raise ckpt.CheckpointError(f"{step_dir / ckpt.META_FILE} has no config.{missing[0]} section; it was not "
                                   f"written by megatron-fp4 (or was edited): restore it from the run's config.yaml")
    return cfg


def saved_run_config(meta: dict, step_dir: Path):
    """meta.json's config as a `Config`, its model sizes within the sanity limits (not validated
    against a world size: the checkpoint may come from any layout)."""
    try:
        cfg = config_from_dict(saved_config(meta, step_dir))
        check_model_limits(cfg)
    except ConfigError as err:
        raise ckpt.CheckpointError(f"{step_dir / ckpt.META_FILE}: its config is not valid ({err}); it was edited "
                                   f"or damaged: restore it from the run's config.yaml") from None
    return cfg


def model_shapes(meta: dict, step_dir: Path) -> dict:
    """name -> shape of the model meta.json's config describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = build_model(saved_run_config(meta, step_dir))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def cmd_inspect(args) -> int:
    state, meta, step_dir = load_model_state(args.checkpoint)
    cfg = saved_config(meta, step_dir)
    model = cfg["model"]
    print(f"checkpoint: {step_dir}")
    print(f"kind: {meta.get('kind')}  step: {meta.get('step')}  format: {meta.get('format_version')}")
    print(f"model: {model.get('num_layers', '?')} layers, hidden {model.get('hidden_size', '?')}, "
          f"{model.get('num_experts', '?')} experts top-{model.get('top_k', '?')}; fp4: {cfg.get('fp4', '?')}")
    print(f"parallel layout it was saved from: {cfg.get('parallel', '?')}")
    total = sum(t.numel() for t in state.values())
    print(f"tensors: {len(state)}  parameters: {total:,}")
    return 0


def vllm_quant_config(cfg, enabled: bool):
    """The `quantization_config` block (the FP4 recipe for the vLLM plugin) of `cfg`, or None."""
    if not enabled:
        return None
    from megatron_fp4.integrations.vllm import hf_quantization_config

    return hf_quantization_config(cfg)


def cmd_to_hf(args) -> int:
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.integrations.hf.checkpoint import check_out_dir

    check_out_dir(args.out, args.overwrite, flag="--overwrite")
    state, meta, step_dir = load_model_state(args.checkpoint)
    cfg = saved_run_config(meta, step_dir)
    model = build_model(cfg)
    model.load_state_dict(state)  # names and shapes were checked against this config by load_model_state
    out = save_hf_checkpoint(model, cfg, args.out, dtype=DTYPES[args.dtype], overwrite=args.overwrite,
                             quantization_config=vllm_quant_config(cfg, not args.no_quant_config))
    print(f"wrote {out} (config.json + model.safetensors, {args.dtype})")
    return 0


def cmd_from_hf(args) -> int:
    from megatron_fp4.integrations.hf import from_hf_state_dict, load_hf_checkpoint

    if (Path(args.out) / ckpt.step_dir_name(0)).exists():
        raise ValueError(f"{Path(args.out) / ckpt.step_dir_name(0)} already exists; from-hf never overwrites a "
                         f"checkpoint: choose a new output directory or remove that one")
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
    p.add_argument("--no-quant-config", action="store_true",
                   help="leave the FP4 recipe (quantization_config for the vLLM plugin) out of config.json")
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
