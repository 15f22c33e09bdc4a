"""TensorBoard logging and the console progress: a tqdm bar on a terminal, plain lines elsewhere."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from megatron_fp4.config import ConfigError

_TB_FIX = "point logging.tensorboard_dir at a (new or existing) directory, or set it to null to turn TensorBoard off"


def check_tensorboard_dir(tb_dir: Optional[str]) -> None:
    """Refuse a `logging.tensorboard_dir` that cannot become a directory (an existing file, a file
    on the way, no write permission), before anything is built; nothing is created here."""
    if not tb_dir:
        return
    path = Path(tb_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"logging.tensorboard_dir={tb_dir!r} is an existing file, not a directory; {_TB_FIX}")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"logging.tensorboard_dir={tb_dir!r}: {str(parent)!r} is a file, not a directory; {_TB_FIX}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"logging.tensorboard_dir={tb_dir!r}: {str(parent)!r} is not writable; {_TB_FIX}")


def _summary_writer(tb_dir: str):
    from torch.utils.tensorboard import SummaryWriter

    check_tensorboard_dir(tb_dir)
    try:
        return SummaryWriter(tb_dir)
    except OSError as err:
        raise ConfigError(f"logging.tensorboard_dir={tb_dir!r}: cannot create it ({err.strerror}); {_TB_FIX}") from None


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class MetricsLogger:
    """Writes scalars to TensorBoard (when `tb_dir` is set, on the logging rank) and shows progress
    on `stream` (default stderr): a tqdm bar whose postfix shows the latest loss when the stream is
    a terminal; otherwise (a Slurm .out file, a pipe, CI) one plain line every `line_interval`
    steps and at the last step, since a bar's carriage-return redraws fill such files."""

    def __init__(self, tb_dir: Optional[str], total_steps: int, initial_step: int = 0, progress: bool = True,
                 enabled: bool = True, line_interval: int = 10, stream=None):
        self.writer = None
        self.enabled = enabled
        if enabled and tb_dir:
            self.writer = _summary_writer(tb_dir)
        self.stream = stream if stream is not None else sys.stderr
        show = enabled and progress
        self.plain = show and not is_terminal(self.stream)
        self.step, self.total, self.line_interval = initial_step, total_steps, max(1, line_interval)
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not show or self.plain,
                        desc="train", unit="step", dynamic_ncols=True, file=self.stream)

    def log(self, step: int, scalars: dict) -> None:
        if self.writer is not None:
            for key, value in scalars.items():
                if value is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)

    def advance(self, loss: float, extra: Optional[dict] = None) -> None:
        postfix = {"loss": f"{loss:.4f}" if math.isfinite(loss) else str(loss)}
        postfix.update(extra or {})
        self.step += 1
        if self.plain and (self.step % self.line_interval == 0 or self.step == self.total):
            fields = ", ".join(f"{key} {value}" for key, value in postfix.items())
            print(f"train step {self.step}/{self.total}: {fields}", file=self.stream, flush=True)
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        if self.enabled:
            if self.plain:
                print(text, file=self.stream, flush=True)
            else:
                self.bar.write(text, file=self.stream)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def start_banner(cfg, mesh) -> str:
    """What this run is and where its outputs go (printed once, by rank 0, before training)."""
    import torch

    from megatron_fp4.model import build_model

    with torch.device("meta"):  # shapes only: no memory, no init cost, whatever the model size
        params = sum(p.numel() for p in build_model(cfg).parameters())
    m, f, p, s, c = cfg.model, cfg.fp4, cfg.parallel, cfg.schedule, cfg.checkpoint
    schedule = f", {p.schedule} × {p.virtual_stages} virtual stages" if mesh.pp > 1 else ""
    fp4 = ("FP4 off (fp4.scope=none)" if f.scope == "none" else
           f"FP4 {f.format} on {f.scope}: train {f.train_mode}, rollout {f.rollout_mode}, grads {f.grad_rounding}")
    saves = (f"{c.dir} (every {c.save_interval} steps and at the end" if c.save_interval else f"{c.dir} (at the end") \
        + (f", newest {c.keep_last} kept)" if c.keep_last else ", all kept)") if c.dir else "none (checkpoint.dir is not set)"
    return "\n".join([
        f"megatron-fp4: model {_count(params)} parameters ({m.num_layers} layers, {m.num_experts} experts top-{m.top_k}, "
        f"hidden {m.hidden_size}); {fp4}",
        f"megatron-fp4: world {mesh.world_size} = pp {mesh.pp} × dp {mesh.dp // getattr(mesh, 'cp', 1)}"
        + (f" × cp {mesh.cp}" if getattr(mesh, "cp", 1) > 1 else "")
        + (f" × tp {mesh.tp}{' (sequence parallel)' if p.sequence_parallel else ''}" if mesh.tp > 1 else "")
        + f" (ep {mesh.ep}, ZeRO-{p.zero_stage}"
        f"{schedule}) on {mesh.device.type}/{mesh.backend}, {cfg.dtype}; {s.train_steps} steps × {s.global_batch_size} "
        f"sequences × {s.seq_len} tokens",
        f"megatron-fp4: checkpoints -> {saves}; tensorboard -> "
        f"{cfg.logging.tensorboard_dir or 'off (logging.tensorboard_dir is null)'}"])


def outputs_pointer(cfg) -> str:
    """Where the finished (or stopped) run left its outputs."""
    where = []
    if cfg.checkpoint.dir:
        where.append(f"checkpoints in {cfg.checkpoint.dir} (resume: --set checkpoint.load=auto; inspect: "
                     f"python tools/convert_checkpoint.py inspect {cfg.checkpoint.dir})")
    if cfg.logging.tensorboard_dir:
        where.append(f"curves: tensorboard --logdir {cfg.logging.tensorboard_dir}")
    return "megatron-fp4: " + ("; ".join(where) if where else "no outputs (checkpoint.dir and logging.tensorboard_dir "
                                                            "are not set)")
