"""Token streams from files, cut into training samples, and the dataset factory.

A *source* is anything with a 1-D ``tokens`` array (documents back to back): `IndexedDataset`,
`NumpyTokenDataset`, or a plain array. `TokenSequenceDataset` cuts it into samples of
``seq_len + 1`` tokens that overlap by one token, as Megatron's GPT dataset does, so the label of
the last position of sample ``i`` is the first input of sample ``i + 1`` and no token is wasted.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from megatron_fp4.config.choices import check_choice
from megatron_fp4.training.data.arithmetic import DEFAULT_OPS, ArithmeticDataset, sample_index
from megatron_fp4.training.data.indexed import IndexedDataset, split_prefix

DATA_KINDS = ("arithmetic", "megatron", "numpy")
RANGE_CHECK_CHUNK = 1 << 24  # tokens per min/max pass: bounded memory on any corpus size


class DataError(ValueError):
    """A data file that cannot train this model (e.g. token ids outside the vocabulary)."""


def check_token_range(tokens, vocab_size: int, path: str, chunk: int = RANGE_CHECK_CHUNK) -> None:
    """Every token id must be in ``[0, vocab_size)``: an id outside would fail deep inside the
    embedding at the first step. One chunked min/max pass over the (memory-mapped) stream."""
    lo, hi = None, None
    for start in range(0, int(tokens.shape[0]), chunk):
        part = np.asarray(tokens[start:start + chunk])
        if part.size:
            a, b = int(part.min()), int(part.max())
            lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
    if lo is not None and (lo < 0 or hi >= vocab_size):
        raise DataError(f"data.path={path!r} holds token ids in [{lo}, {hi}] but model.vocab_size={vocab_size} "
                        f"allows only [0, {vocab_size - 1}]; set model.vocab_size to at least {hi + 1} "
                        f"or re-tokenize the data with the model's tokenizer")


class NumpyTokenDataset:
    """A 1-D ``.npy`` file of integer token ids, memory-mapped."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"numpy token file {self.path!r} does not exist; save one with np.save(path, tokens_1d)")
        try:
            tokens = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:  # bad magic/header, truncated, object (pickled) dtype
            why = "no .npy header; pickled data is never loaded" if "pickle" in str(err) else str(err)
            raise ValueError(f"numpy token file {self.path!r} is not a readable .npy array ({why}); save 1-D "
                             "integer token ids with np.save(path, tokens_1d)") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{self.path!r} holds an array of shape {tokens.shape} and dtype {tokens.dtype}; a token file "
                "must be 1-D integer token ids (flatten documents into one stream before np.save)"
            )
        self.tokens = tokens

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_tokens


class TokenSequenceDataset(torch.utils.data.Dataset):
    """Samples of ``seq_len + 1`` tokens (int64) cut from a source's token stream."""

    def __init__(self, source, seq_len: int):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be an integer >= 1")
        tokens = getattr(source, "tokens", source)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.numpy()
        tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
        if tokens.ndim != 1:
            raise ValueError(f"the token stream must be 1-D, got shape {tokens.shape}")
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(
                f"the token stream has {tokens.shape[0]} tokens, fewer than one sample of seq_len+1="
                f"{seq_len + 1}; use more data or a smaller seq_len"
            )
        self.source = source
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (tokens.shape[0] - 1) // seq_len

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        index = sample_index(index, self.num_samples, "TokenSequenceDataset")
        start = index * self.seq_len
        return torch.from_numpy(np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))


def _field(cfg, name: str, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _require_file(cfg_path: str, path: str, what: str, fix: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"data.path={cfg_path!r}: {what} {path!r} does not exist; {fix}")


def build_dataset(data_cfg, seq_len: int, seed: int, vocab_size: int | None = None) -> torch.utils.data.Dataset:
    """The training dataset a data config describes (duck-typed: reads ``kind``, ``path``,
    ``num_samples``, ``max_operand`` and optionally ``ops``; a dict works too).

    ``seed`` only shapes the generated arithmetic corpus; file datasets are shuffled by the sampler.
    With ``vocab_size`` the token ids of a file are checked against it (`DataError`).
    """
    kind = _field(data_cfg, "kind", "arithmetic")
    if kind == "arithmetic":
        return ArithmeticDataset(
            num_samples=_field(data_cfg, "num_samples"),
            seq_len=seq_len,
            seed=seed,
            max_operand=_field(data_cfg, "max_operand", 99),
            ops=_field(data_cfg, "ops", DEFAULT_OPS) or DEFAULT_OPS,
        )
    check_choice("data.kind", kind, DATA_KINDS)
    path = _field(data_cfg, "path")
    if not path:
        raise ValueError(f"data.kind={kind!r} reads a file, but data.path is not set; set data.path")
    path = os.fspath(path)
    try:  # every problem with the file is a DataError (one line at the CLI), naming the file
        if kind == "megatron":
            prefix = split_prefix(path)
            fix = "set data.path to the prefix shared by the .bin and .idx files"
            _require_file(path, prefix + ".idx", "Megatron index file", fix)
            _require_file(path, prefix + ".bin", "Megatron data file", fix)
            source = IndexedDataset(prefix)
        else:
            _require_file(path, path, "numpy token file", "set data.path to a 1-D .npy file of token ids")
            source = NumpyTokenDataset(path)
        if vocab_size is not None:
            check_token_range(source.tokens, vocab_size, path)
        return TokenSequenceDataset(source, seq_len)
    except DataError:
        raise
    except ValueError as err:
        raise DataError(str(err)) from err
