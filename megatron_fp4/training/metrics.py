"""TensorBoard logging and the console progress bar."""
from __future__ import annotations

import math
from typing import Optional

from tqdm.auto import tqdm


class MetricsLogger:
    """Writes scalars to TensorBoard (when `tb_dir` is set, on the logging rank) and drives a tqdm
    progress bar whose postfix shows the latest loss."""

    def __init__(self, tb_dir: Optional[str], total_steps: int, initial_step: int = 0, progress: bool = True,
                 enabled: bool = True):
        self.writer = None
        self.enabled = enabled
        if enabled and tb_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tb_dir)
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not (enabled and progress),
                        desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, scalars: dict) -> None:
        if self.writer is not None:
            for key, value in scalars.items():
                if value is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)

    def advance(self, loss: float, extra: Optional[dict] = None) -> None:
        postfix = {"loss": f"{loss:.4f}" if math.isfinite(loss) else str(loss)}
        postfix.update(extra or {})
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
