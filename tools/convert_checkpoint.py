"""Checkpoint conversion: ours <-> Hugging Face safetensors (every model family: Qwen3-MoE, GPT-OSS,
chosen by config.json's model_type / the checkpoint's model.family), and inspection.

    python tools/convert_checkpoint.py inspect outputs/tiny_moe/checkpoints
    python tools/convert_checkpoint.py to-hf   outputs/tiny_moe/checkpoints  hf_out/ [--dtype bf16] [--no-quant-config]
    python tools/convert_checkpoint.py from-hf hf_out/  converted/           [--set fp4.scope=experts ...]
    python tools/convert_checkpoint.py upgrade old_ckpt/step_00000100 new_ckpt/

An unknown model_type (or any other bad input) is one error line and exit status 2. `to-hf
--mxfp4-experts` (GPT-OSS) writes the expert weights packed in MXFP4 as OpenAI's checkpoints do.

`to-hf` reads a DCP checkpoint (any parallel layout, one process included; expert and pipeline
shards are gathered) or one of the former single-file format ("single"/"weights": ``state.pt``,
read with ``torch.load(weights_only=True)`` after its checksums) and writes `config.json` + `model.safetensors`;
config.json carries the checkpoint's FP4 recipe as `quantization_config` (`quant_method`
"megatron_fp4": vLLM with this package installed serves it with MoEResQ, docs/vllm.md;
transformers ignores the block), `--no-quant-config` leaves it out.
`from-hf` writes a DCP checkpoint of the weights (step 0, no optimizer state) plus ``config.yaml``;
train from it with ``megatron-fp4-train --config converted/config.yaml --set checkpoint.load=converted``.
`upgrade` turns a checkpoint of the former single-file format, which the trainer no longer
resumes, into a DCP one: weights, AdamW moments and masters, step, sampler position, RNG.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_fp4.config import ConfigError, NumericsConfig, apply_overrides, config_from_dict
from megatron_fp4.config.validate import check_model_limits
from megatron_fp4.model import build_model
from megatron_fp4.model.registry import numerics_level_for
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import files

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model_state(path: str) -> tuple[dict, dict, Path]:
    """(model state dict with global names, meta, step dir) of any of our checkpoint kinds; for a
    root, the newest intact step (damaged ones are skipped with a warning)."""
    def load_one(step_dir: Path):
        meta = ckpt.read_meta(step_dir)
        kind = meta.get("kind")
        if kind in ckpt.LEGACY_KINDS:
            state, meta = legacy_state(step_dir)
            return state["model"], meta, step_dir
        if kind == "dcp":
            from megatron_fp4.training.checkpoint.dcp import read_full_model_state

            shapes = model_shapes(meta, step_dir)
            state = read_full_model_state(step_dir, meta, shapes)
            ckpt.check_state_fits(shapes, state, step_dir)  # also none missing (e.g. meta.json claims more layers)
            return state, meta, step_dir
        raise ckpt.CheckpointError(f"{step_dir / ckpt.META_FILE}: unknown checkpoint kind {kind!r} (expected "
                                   f"'dcp', or 'single'/'weights' of the former format)")

    return ckpt.with_fallback(path, load_one)


def legacy_state(step_dir: Path) -> tuple[dict, dict]:
    """(state, meta) of a former single-file checkpoint, its 'model' checked against meta's config."""
    state, meta = ckpt.load_legacy_step(step_dir)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ckpt.CheckpointError(f"{step_dir / ckpt.STATE_FILE} has no 'model' state dict; it was not "
                                   f"written by megatron-fp4")
    ckpt.check_state_fits(model_shapes(meta, step_dir), state["model"], step_dir)
    return state, meta


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
    print(f"model: {model.get('family', 'qwen3_moe')}, {model.get('num_layers', '?')} layers, hidden {model.get('hidden_size', '?')}, "
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

    check_out_dir(args.out, args.overwrite, flag="--overwrite", inputs=(args.checkpoint,))
    state, meta, step_dir = load_model_state(args.checkpoint)
    cfg = saved_run_config(meta, step_dir)
    model = build_model(cfg)
    model.load_state_dict(state)  # names and shapes were checked against this config by load_model_state
    out = save_hf_checkpoint(model, cfg, args.out, dtype=DTYPES[args.dtype], overwrite=args.overwrite,
                             quantization_config=vllm_quant_config(cfg, not args.no_quant_config),
                             inputs=(args.checkpoint,), mxfp4_experts=args.mxfp4_experts)
    print(f"wrote {out} (config.json + model.safetensors, {args.dtype})")
    return 0


def cmd_from_hf(args) -> int:
    from megatron_fp4.integrations.hf import from_hf_state_dict, load_hf_checkpoint

    check_new_checkpoint_dir(args.out, args.hf)
    if (Path(args.out) / ckpt.step_dir_name(0)).exists():
        raise ValueError(f"{Path(args.out) / ckpt.step_dir_name(0)} already exists; from-hf never overwrites a "
                         f"checkpoint: choose a new output directory or remove that one")
    model_cfg, hf_state = load_hf_checkpoint(args.hf)
    data = {"model": {k: getattr(model_cfg, k) for k in model_cfg.__dataclass_fields__}}
    data["numerics"] = {"invariance": numerics_level_for(model_cfg.family, NumericsConfig().invariance)}
    cfg = config_from_dict(apply_overrides(data, args.overrides))
    trainer = one_process_trainer(cfg)
    from_hf_state_dict(trainer.model, hf_state)
    out = write_dcp(trainer, args.out)
    print(f"wrote {out} (weights, step 0); train with: megatron-fp4-train --config {Path(args.out) / ckpt.CONFIG_FILE} "
          f"--set checkpoint.load={args.out}")
    return 0


def cmd_upgrade(args) -> int:
    check_new_checkpoint_dir(args.out, args.checkpoint)
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise ValueError(f"{args.out} is not empty; upgrade writes a new checkpoint directory: choose a new one")
    state, meta = ckpt.with_fallback(args.checkpoint, legacy_state)
    trainer = one_process_trainer(saved_run_config(meta, Path(args.checkpoint)))
    load_legacy_into(trainer, state, meta)
    out = write_dcp(trainer, args.out)
    print(f"wrote {out} (DCP, step {trainer.step}); resume with --set checkpoint.load={args.out}")
    return 0


def check_new_checkpoint_dir(out: str, source: str) -> None:
    """`out` may become a checkpoint root: a directory or nothing yet, and not the input or touching it."""
    ckpt.check_not_input(out, (source,))
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{out!r} exists and is not a directory; the checkpoint is written as a directory: "
                         f"choose a new output path")


def load_legacy_into(trainer, state: dict, meta: dict) -> None:
    """Weights, step, sampler, RNG and (for "single") the AdamW state of a former single-file
    checkpoint into a one-process trainer. That format's optimizer was torch AdamW over the params
    requiring grad, decayed ones first (`model.specs.no_weight_decay`), with fp32 masters saved for
    the non-fp32 params; ZeroAdamW at dp=1 holds the same numbers in flat buffers."""
    with torch.no_grad():
        trainer.model.load_state_dict(state["model"])
    trainer.step = meta["step"] if meta.get("kind") == "single" else 0
    if isinstance(state.get("sampler"), dict):
        trainer.sampler = _SavedSampler(state["sampler"])
    rng = state.get("rng")
    if isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor):
        torch.set_rng_state(rng["torch"])
    if meta.get("kind") == "single":
        _legacy_adam_into(trainer, state.get("optimizer"), state.get("masters") or {})


class _SavedSampler:
    """The sampler position of a legacy checkpoint, for the DCP save (which only asks for it)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def _legacy_adam_into(trainer, opt_state, masters: dict) -> None:
    from megatron_fp4.model.specs import no_weight_decay

    params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    names = [n for n, p in params if not no_weight_decay(n, p)] + [n for n, p in params if no_weight_decay(n, p)]
    groups = opt_state.get("param_groups") if isinstance(opt_state, dict) else None
    order = [i for g in groups or () for i in g.get("params", ())]
    if sorted(order) != list(range(len(names))):
        raise ckpt.CheckpointError(f"the optimizer state holds {len(order)} parameters, the model {len(names)}: it "
                                   f"was not written by megatron-fp4's single-process trainer")
    by_name = {names[k]: (opt_state.get("state") or {}).get(i, {}) for k, i in enumerate(order)}
    opt = trainer.optimizer
    for k, buf in enumerate(opt.buffers):
        flat = {key: torch.zeros_like(t) for key, t in opt.adam_state(k).items() if key != "step"}
        step = 0.0
        for i, name in enumerate(buf.names):
            lo, n = buf.offsets[i], buf.params[i].numel()
            st = by_name[name]
            flat["master"][lo:lo + n] = masters.get(name, buf.params[i].detach()).reshape(-1)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    flat[key][lo:lo + n] = st[key].reshape(-1)
            step = float(st.get("step", step))
        opt.set_adam_state(k, flat["master"], flat["exp_avg"], flat["exp_avg_sq"], step)


def one_process_trainer(cfg):
    """A trainer of `cfg` in this process (a mesh of size 1, no data): what writes the DCP files."""
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    return Trainer(cfg, ParallelMesh.single(), build_data=False)


def write_dcp(trainer, out: str) -> Path:
    """The trainer's checkpoint under `out`, with the config next to it (a file `--config` accepts)."""
    import yaml

    step_dir = trainer.save_checkpoint(out)
    files.write_durable_text(Path(out) / ckpt.CONFIG_FILE, yaml.safe_dump(trainer.cfg.to_dict(), sort_keys=False))
    return step_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print what a checkpoint holds")
    p.add_argument("checkpoint")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("to-hf", help="our checkpoint -> HF safetensors of its model family")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-quant-config", action="store_true",
                   help="leave the FP4 recipe (quantization_config for the vLLM plugin) out of config.json")
    p.add_argument("--mxfp4-experts", action="store_true",
                   help="GPT-OSS: write the expert weights packed in MXFP4 (*_blocks/*_scales) as OpenAI's checkpoints "
                        "hold them; they must lie on the MXFP4 grid")
    p.set_defaults(fn=cmd_to_hf)
    p = sub.add_parser("from-hf", help="HF safetensors (Qwen3-MoE, GPT-OSS: by config.json's model_type) -> our "
                                       "weights-only checkpoint")
    p.add_argument("hf")
    p.add_argument("out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(fn=cmd_from_hf)
    p = sub.add_parser("upgrade", help="a checkpoint of the former single-file format (state.pt) -> DCP")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.set_defaults(fn=cmd_upgrade)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as err:  # OSError: e.g. a parent of the output is a file or not writable
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
