"""Packed sequences (``model/packing.py``, ``training/packing.py``): prompts + responses back to back
in one row, positions restarting per sequence, attention within each sequence.

At the ``batch`` and ``exact`` levels a packed forward gives every token the padded forward's bits
(by construction: attention runs on each sequence unpacked into its own row, whose result depends
only on the row; every other op is per token), so those comparisons are exact. At ``standard`` the
attention kernels differ (SDPA's causal kernel on the unpacked rows vs a masked one on the padded
rows), so the comparison runs in float64 with tolerance 1e-10: the sums behind a log-prob have a
few hundred terms of magnitude <= ~30, so reordering them moves it by at most ~1e3 · 2^-53 · 30 ≈
3e-12 per op over the few dozen ops of a tiny model. The mutations (positions not restarting,
attention across a boundary) must break the equality.
"""
from __future__ import annotations

import random

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.model import build_model
from megatron_fp4.model import packing as model_packing
from megatron_fp4.rollout.engine import pad_prompt_response, positions_from_mask
from megatron_fp4.rollout.scoring import compute_log_probs
from megatron_fp4.training.packing import (balanced_bins, check_budget, pack_rows, real_lengths, token_bins,
                                           unpack_rows)
from tests.numerics import single_thread


def tiny_model(seed: int = 0, scope: str = "experts", level: str = "batch", mode=None):
    """The model at numerics level `level` and FP4 `mode` (None: as built), both fixed at build."""
    cfg = Config()
    cfg.model.vocab_size = 32
    cfg.model.num_layers = 2
    cfg.fp4.scope = scope
    model = build_model(cfg, seed=seed)
    apply_numerics(model, Numerics(invariance=level))
    if mode is not None:
        model.set_fp4_mode(mode)
    return model


def sequences(seed: int, n: int, prompt=(2, 9), response=(1, 12)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 32) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    responses = [[rng.randrange(1, 32) for _ in range(rng.randint(*response))] for _ in range(n)]
    return prompts, responses


def packed_log_probs(model, batch, bins, mode, level, pad_to=None):
    """Per-token log-probs of `batch` scored in packed micro-batches `bins`, put back in the padded layout."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for rows in bins:
        mb = pack_rows(batch, rows, pad_to)
        with torch.no_grad():
            lp = compute_log_probs(model, mb["input_ids"], mb["attention_mask"], mb["response_mask"], mode,
                                   invariance=level).log_probs
        unpack_rows(lp, mb["token_slots"], out)
    return out


def padded_log_probs(model, batch, mode, level):
    with torch.no_grad():
        return compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], mode,
                                 invariance=level).log_probs


@pytest.mark.parametrize("level,mode,scope", [("batch", "fp4_resq", "experts"), ("batch", "bf16", "experts"),
                                              ("batch", "fp4_resq", "experts+attention"),
                                              ("exact", "fp4_resq", "experts")])
def test_packed_log_probs_equal_padded_bitwise(level, mode, scope):
    with single_thread():
        model = tiny_model(1, scope, level, mode)
        batch = pad_prompt_response(*sequences(2, 7), pad_id=0)
        want = padded_log_probs(model, batch, mode, level)
        bins = token_bins(real_lengths(batch["attention_mask"]), 40)
        assert len(bins) > 1 and any(len(b) > 1 for b in bins)
        got = packed_log_probs(model, batch, bins, mode, level, pad_to=40)  # trailing padding too
    keep = batch["response_mask"].bool()
    assert torch.equal(got[keep].float().view(torch.int32), want[keep].view(torch.int32))
    assert (got[~keep] == 0).all()


def test_packed_log_probs_standard_level_fp64():
    with single_thread():
        model = tiny_model(3, level="standard", mode="bf16").double()
        batch = pad_prompt_response(*sequences(4, 6), pad_id=0)
        want = padded_log_probs(model, batch, "bf16", "standard")
        got = packed_log_probs(model, batch, token_bins(real_lengths(batch["attention_mask"]), 64), "bf16", "standard")
    keep = batch["response_mask"].bool()
    assert want.dtype == torch.float64
    assert (got[keep] - want[keep]).abs().max() <= 1e-10


@pytest.mark.parametrize("mutation", ["positions_continue", "attention_crosses"])
def test_packing_mutations_break_the_equality(monkeypatch, mutation):
    """The checks above can fail: positions that do not restart, or one sequence attending to another."""
    if mutation == "positions_continue":
        def positions(mask):
            return torch.arange(mask.shape[1]).expand_as(mask)
        monkeypatch.setattr("megatron_fp4.rollout.scoring.segment_positions", positions)
    else:  # every packed row one sequence: attention crosses the boundaries
        real_of = model_packing.SequenceLayout.of
        monkeypatch.setattr(model_packing.SequenceLayout, "of",
                            classmethod(lambda cls, m: real_of((m != 0).long() * 2)))
    with single_thread():
        model = tiny_model(1, mode="fp4_resq")
        batch = pad_prompt_response(*sequences(2, 5), pad_id=0)
        want = padded_log_probs(model, batch, "fp4_resq", "batch")
        bins = [list(range(5))]
        got = packed_log_probs(model, batch, bins, "fp4_resq", "batch")
    keep = batch["response_mask"].bool()
    assert not torch.equal(got[keep].float(), want[keep])


def test_segment_positions():
    mask = torch.tensor([[1, 1, 1, 2, 2, 3, 0], [0, 0, 1, 1, 1, 0, 0]])
    assert model_packing.segment_positions(mask).tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 0, 1, 2, 0, 0]]
    padded = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    assert torch.equal(model_packing.segment_positions(padded), positions_from_mask(padded))  # today's integers
    layout = model_packing.SequenceLayout.of(mask[:1])
    assert layout.index.tolist() == [[0, 1, 2], [3, 4, 0], [5, 0, 0]]
    x = torch.arange(7.0).view(1, 7)
    assert layout.repack(layout.unpack(x)).tolist() == [[0, 1, 2, 3, 4, 5, 0]]


def test_token_bins_first_fit_decreasing_deterministic_and_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = token_bins(lengths, 64)
    assert bins == token_bins(list(lengths), 64)  # deterministic
    assert sorted(i for b in bins for i in b) == list(range(40))  # every row once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert all(b == sorted(b) for b in bins)
    assert token_bins([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]  # 5 | 4 | 3 -> with 4 | 2 -> with 5
    assert sum(lengths) / 64 <= len(bins) <= len(lengths)


def test_over_long_sequence_and_bad_budget_refused():
    with pytest.raises(ValueError, match="rl.max_tokens_per_micro_batch=8"):
        token_bins([3, 9, 2], 8)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="rl.max_tokens_per_micro_batch"):
            check_budget(bad)
    assert check_budget(None) == 0 and check_budget(0) == 0 and check_budget(16) == 16


def test_balanced_bins_give_every_share_the_same_count():
    lengths = [30, 30, 30, 30, 5, 5, 5, 5]  # share 0 needs 4 bins at 32 tokens, share 1 one
    per = balanced_bins(lengths, 32, shares=2, minimum=2)
    assert [len(b) for b in per] == [4, 4]
    assert sorted(i for b in per[1] for i in b) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="data-parallel shares"):
        balanced_bins(lengths, 32, shares=3)


def test_pack_rows_layout():
    batch = pad_prompt_response([[7, 8], [9]], [[1, 2, 3], [4]], pad_id=0)
    batch["advantages"] = torch.tensor([0.5, -1.0])
    mb = pack_rows(batch, [0, 1], pad_to=9)
    assert mb["input_ids"].tolist() == [[7, 8, 1, 2, 3, 9, 4, 0, 0]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 2, 2, 0, 0]]
    assert mb["response_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 1, 0, 0]]
    assert mb["advantages"].tolist() == [[0.5] * 5 + [-1.0] * 2 + [0.0] * 2]
    T = batch["input_ids"].shape[1]
    assert mb["token_slots"].tolist() == [[0, 1, 2, 3, 4, T + 1, T + 2, -1, -1]]


def test_length_classes_cover_every_token_once_within_twice_the_tokens():
    mask = torch.tensor([[1] * 40 + [2] + [3, 3] + [4] * 5 + [5] * 3 + [6] * 17 + [0] * 4])
    layout = model_packing.SequenceLayout.of(mask)
    groups = layout.by_length()
    slots = torch.cat([g.index[g.valid] for g in groups])
    assert sorted(slots.tolist()) == list(range(68))  # each real token once
    assert sum(g.index.numel() for g in groups) <= 2 * 68 < layout.index.numel()
    x = torch.randn(1, mask.shape[1], 3)
    out = None
    for g in groups:
        out = g.repack(g.unpack(x), out)
    assert torch.equal(out[0, :68], x[0, :68]) and (out[0, 68:] == 0).all()


def test_packing_refused_where_it_cannot_run():
    from megatron_fp4.config import ConfigError, load_config
    from megatron_fp4.model import KVCache

    with pytest.raises(ConfigError, match="rl.max_tokens_per_micro_batch.*parallel.cp=2"):
        load_config(overrides=["rl.max_tokens_per_micro_batch=64", "parallel.cp=2"]).validate()
    with pytest.raises(ConfigError, match="rl.max_tokens_per_micro_batch.*gpt_oss"):
        load_config(overrides=["rl.max_tokens_per_micro_batch=64", "model.family=gpt_oss",
                                "numerics.invariance=standard"]).validate()
    with pytest.raises(ConfigError, match="rl.max_tokens_per_micro_batch"):
        load_config(overrides=["rl.max_tokens_per_micro_batch=-1"])
    model = tiny_model()
    mask = torch.tensor([[1, 1, 2, 2]])
    with pytest.raises(ValueError, match="not with a KV cache nor context parallelism"):
        model(torch.tensor([[3, 4, 5, 6]]), model_packing.segment_positions(mask), mask,
              kv_cache=KVCache.empty(len(model.layers)))
