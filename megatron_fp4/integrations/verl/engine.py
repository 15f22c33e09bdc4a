"""verl training engine (BaseEngine, EngineRegistry backend "megatron_fp4") over our `Trainer`.

Batches are verl's padded layout (TensorDict or DataProto.batch): `input_ids`/`attention_mask`
[B, P+R] (left-padded prompts, right-padded responses), `responses` [B, R], `response_mask` [B, R].
The model output handed to `loss_function(model_output, data, dp_group)` is
{"log_probs": [B, R]} computed with the training-side FP4 mode (`cfg.fp4.train_mode`), the same
forward the trainer uses for its LM loss.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
from verl.workers.engine.base import BaseEngine, EngineRegistry

from megatron_fp4.config import Config
from megatron_fp4.rollout.scoring import compute_log_probs


@EngineRegistry.register(model_type="language_model", backend="megatron_fp4", device=["cpu", "cuda"])
class MegatronFP4Engine(BaseEngine):
    def __init__(self, cfg: Optional[Config] = None, micro_batch_size: Optional[int] = None, trainer=None, **kwargs):
        self.cfg = cfg if cfg is not None else (trainer.cfg if trainer is not None else Config())
        self.micro_batch_size = micro_batch_size
        self.trainer = trainer
        self.mode = None

    def initialize(self):
        if self.trainer is None:
            from megatron_fp4.training.trainer import Trainer
            self.trainer = Trainer(self.cfg, build_data=False)
        return self

    @property
    def model(self):
        return self.trainer.model

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextlib.contextmanager
    def _ctx(self, mode: str):
        self.mode = mode
        self.model.train(mode == "train")
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs):
        return self._ctx("train")

    def eval_mode(self, **kwargs):
        return self._ctx("eval")

    # -- optimizer ---------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        self.trainer.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip and step; a non-finite gradient norm skips the step (weights unchanged)."""
        from megatron_fp4.training.optim import clip_coefficient, lr_at

        opt = self.trainer.optimizer
        opt.finish_grad_sync()
        grad_norm = opt.grad_norm()
        if not math.isfinite(grad_norm):
            opt.zero_grad()
            return grad_norm
        opt.step(lr_at(self.trainer.step, self.cfg.optimizer, self.cfg.schedule),
                 clip_coefficient(grad_norm, self.cfg.optimizer.clip_grad))
        return grad_norm

    def lr_scheduler_step(self) -> float:
        from megatron_fp4.training.optim import lr_at

        self.trainer.step += 1
        return lr_at(self.trainer.step, self.cfg.optimizer, self.cfg.schedule)

    # -- forward / backward ------------------------------------------------------------------------
    def response_log_probs(self, micro_batch) -> torch.Tensor:
        R = micro_batch["responses"].shape[1]
        lp = compute_log_probs(self.model, micro_batch["input_ids"], micro_batch["attention_mask"]).log_probs[:, -R:]
        if "response_mask" in micro_batch.keys():
            lp = lp * micro_batch["response_mask"].to(lp.dtype)
        return lp

    def forward_backward_batch(self, data, loss_function: Optional[Callable], forward_only=False) -> dict:
        B = data["input_ids"].shape[0]
        mbs = self.micro_batch_size or B
        log_probs, losses, metrics = [], [], {}
        for start in range(0, B, mbs):
            mb = data[start:start + mbs]
            weight = mb["input_ids"].shape[0] / B
            lp = self.response_log_probs(mb)
            if loss_function is not None:
                loss, extra = loss_function(model_output={"log_probs": lp}, data=mb, dp_group=None)
            else:
                assert forward_only, "loss_function is required unless forward_only=True"
                loss, extra = lp.new_zeros(()), {}
            if not forward_only:
                (loss * weight).backward()
            log_probs.append(lp.detach())
            losses.append(float(loss.detach()))
            for k, v in extra.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * weight
        return {"model_output": {"log_probs": torch.cat(log_probs)}, "loss": losses, "metrics": metrics}

    # -- weights and layout --------------------------------------------------------------------------
    def get_per_tensor_param(self, **kwargs):
        return ((n, t.detach()) for n, t in self.model.state_dict().items()), None

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model, optimizer, grad)
        if model and device in ("cpu", "cuda"):
            self.trainer.model.to(device)

    def save_checkpoint(self, local_path: str, hdfs_path=None, global_step: int = 0, max_ckpt_to_keep=None, **kw):
        self.trainer.save_checkpoint(local_path)

    def load_checkpoint(self, local_path: str, hdfs_path=None, del_local_after_load: bool = False, **kw):
        self.trainer.load_checkpoint(local_path)
