"""Resumable, data-parallel-aware batch sampling and batch assembly.

The sampler's state is counted in *global* samples (epoch, samples consumed in that epoch), never
in per-rank steps, so a run resumed with a different data-parallel size sees exactly the global
batches the uninterrupted run would have seen; only the split across ranks changes.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from megatron_fp4.training.data.token_datasets import DataError

IGNORE_INDEX = -100  # the default ignore_index of torch.nn.functional.cross_entropy


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


class ResumableSampler:
    """Yields, step after step, this data-parallel rank's sample indices of the next global batch.

    Each epoch is a permutation of ``range(dataset_len)`` drawn from a ``torch.Generator`` seeded
    with ``seed + epoch`` (identity when ``shuffle=False``). Global batches are consecutive slices
    of ``global_batch_size`` samples; an incomplete tail is skipped so every step has a full
    batch. Rank ``r`` of ``dp_size`` gets the ``r``-th of ``dp_size`` equal contiguous parts.

    Iteration never ends (epochs follow each other); the training loop decides how many steps to
    run. The state advances when a batch is handed out, so `state_dict` taken after the loop has
    used ``k`` batches resumes at batch ``k + 1`` -- do not prefetch batches past a checkpoint.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        _check_int("dataset_len", dataset_len, 1)
        _check_int("global_batch_size", global_batch_size, 1)
        _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be smaller than dp_size={dp_size}")
        if global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the data-parallel size "
                f"dp_size={dp_size}; choose a global batch size that is a multiple of {dp_size}"
            )
        if global_batch_size > dataset_len:  # the data the config points at: a user error (one line at the CLI)
            raise DataError(
                f"schedule.global_batch_size={global_batch_size} is larger than the dataset ({dataset_len} samples: "
                "data.num_samples, or (tokens - 1) // schedule.seq_len of the data.path file); use a smaller batch "
                "or more data"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.consumed = 0
        self._cached_epoch: int | None = None
        self._cached_order: torch.Tensor | None = None

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (cached for the current epoch)."""
        if self._cached_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=generator)
            else:
                order = torch.arange(self.dataset_len)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order

    def next_global_batch(self) -> list[int]:
        """All ranks' indices of the next step (advances the state)."""
        # The epoch rolls over here, not when the last batch is handed out, so a state resumed with
        # a different global batch size still finishes the epoch with as many batches as fit.
        if self.consumed + self.global_batch_size > self.dataset_len:
            self.epoch += 1
            self.consumed = 0
        order = self.epoch_order(self.epoch)
        batch = order[self.consumed : self.consumed + self.global_batch_size]
        self.consumed += self.global_batch_size
        return batch.tolist()

    def next_batch(self) -> list[int]:
        """This rank's indices of the next step (advances the state)."""
        batch = self.next_global_batch()
        start = self.dp_rank * self.local_batch_size
        return batch[start : start + self.local_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("epoch", "consumed"):
            if key not in state:
                raise ValueError(f"sampler state {state!r} has no {key!r}; pass a dict from ResumableSampler.state_dict()")
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"sampler state {key}={value!r} must be a non-negative integer")
        if state["consumed"] > self.dataset_len:
            raise ValueError(
                f"sampler state consumed={state['consumed']} exceeds the dataset length {self.dataset_len}; "
                "the checkpoint was made with a different dataset (check data.path / data.num_samples)"
            )
        self.epoch = state["epoch"]
        self.consumed = state["consumed"]


def get_batch(dataset, indices: Sequence[int], pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples of ``seq_len + 1`` tokens into ``(tokens[B, seq_len], labels[B, seq_len])``.

    ``labels`` is the sequence shifted by one. Positions whose input or label is padding get
    `IGNORE_INDEX` so the loss skips them. ``pad_id`` defaults to ``dataset.pad_id`` when the
    dataset has one (the arithmetic corpus); file datasets have no padding and no masking.
    """
    if len(indices) == 0:
        raise ValueError("get_batch needs at least one sample index")
    samples = torch.stack([torch.as_tensor(dataset[int(i)], dtype=torch.long) for i in indices])
    if samples.dim() != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be 1-D with seq_len+1 >= 2 tokens, got a stack of shape {tuple(samples.shape)}")
    tokens = samples[:, :-1].contiguous()
    labels = samples[:, 1:].clone()
    if pad_id is None:
        pad_id = getattr(dataset, "pad_id", None)
    if pad_id is not None:
        labels[(tokens == pad_id) | (labels == pad_id)] = IGNORE_INDEX
    return tokens, labels
