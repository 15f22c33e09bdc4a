"""Pure pipeline layout: layer split, chunk placement, stage modules with global names."""
import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.parallel.pipeline import (build_chunks, chunk_to_rank, rank_chunks, schedule_class, split_layers,
                                            theoretical_bubble)


@pytest.mark.parametrize("layers,pp,v", [(4, 2, 1), (4, 2, 2), (7, 2, 2), (10, 4, 1), (5, 1, 1), (9, 3, 3)])
def test_split_layers_is_balanced_contiguous_and_complete(layers, pp, v):
    ranges = split_layers(layers, pp, v)
    assert len(ranges) == pp * v
    assert [i for r in ranges for i in r] == list(range(layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra layers go to the earliest chunks


def test_split_layers_rejects_more_chunks_than_layers():
    with pytest.raises(ValueError, match="virtual_stages"):
        split_layers(3, 2, 2)


def test_interleaved_placement():
    assert rank_chunks(0, 2, 2) == [0, 2] and rank_chunks(1, 2, 2) == [1, 3]
    assert [chunk_to_rank(c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    for pp, v in [(2, 2), (4, 3)]:
        assert sorted(c for r in range(pp) for c in rank_chunks(r, pp, v)) == list(range(pp * v))


def test_theoretical_bubble():
    assert theoretical_bubble(2, 1, 4) == pytest.approx(0.25)
    assert theoretical_bubble(4, 2, 8) == pytest.approx(3 / 16)


def test_schedule_names():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    assert schedule_class("1f1b") is Schedule1F1B
    assert schedule_class("interleaved_1f1b") is ScheduleInterleaved1F1B
    with pytest.raises(ValueError, match="parallel.schedule"):
        schedule_class("pipedream")


def test_chunks_keep_global_names_and_compose_to_the_full_model():
    cfg = Config()
    cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    full = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 8))
    want = full(tokens).logits
    all_names = {n for n, _ in full.named_parameters()}
    names, chunks = set(), {}
    for rank in range(2):
        model = build_model(cfg).eval()
        for c, chunk in build_chunks(model, pp=2, pp_rank=rank, virtual_stages=2):
            chunks[c] = chunk
        local = {n for n, _ in model.named_parameters()}
        assert local <= all_names and not (local & names)
        names |= local
    assert names == all_names
    h = tokens
    for c in range(4):
        h = chunks[c](h)
    assert torch.equal(h, want)
    assert "embed_tokens.weight" in {n for n, _ in chunks[0].named_parameters()}
    assert "lm_head.weight" in {n for n, _ in chunks[3].named_parameters()}


def test_chunks_run_the_models_own_forward_pieces():
    """A stage calls the model's `embed` / `run_layers` / `head` (one forward for every layout):
    a change to a piece shows up in the chunks, and the chunk passes the micro-batch's positions
    and padding mask to the layers."""
    cfg = Config()
    cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    extra = {"positions": positions, "attention_mask": mask}
    want = model(tokens, positions, mask).logits
    calls = []
    for piece in ("embed", "run_layers", "head"):
        def traced(*args, _piece=piece, _original=getattr(model, piece), **kwargs):
            calls.append(_piece)
            return _original(*args, **kwargs)
        setattr(model, piece, traced)
    [(_, chunk)] = build_chunks(model, pp=1, pp_rank=0)
    assert torch.equal(chunk(tokens, **extra), want)  # the schedule's per-micro-batch kwargs
    assert calls == ["embed", "run_layers", "head"]
