"""GPT-OSS's packed MXFP4 experts (`integrations/hf/mxfp4_experts.py`) against transformers' own
dequantizer, ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (fp32 output): bitwise,
since both compute code value · 2^(scale − 127) exactly. Weights read from MXFP4 lie on the grid,
so the project's MXFP4 weight quantizer gives them back unchanged (Q(W) = W), bit for bit.
"""
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from megatron_fp4.config import FP4Config
from megatron_fp4.fp4 import fake_quantize
from megatron_fp4.integrations.hf import (build_model_from_hf, from_hf_state_dict, ours_config_from_hf,
                                          save_hf_checkpoint, to_hf_state_dict)
from megatron_fp4.integrations.hf.checkpoint import SafetensorsTensors
from megatron_fp4.integrations.hf.mxfp4_experts import dequantize, pack, read
from megatron_fp4.model import MoETransformer
from megatron_fp4.model.specs import recipe_from_config

E, H, F = 4, 64, 32  # experts, hidden, ffn (both multiples of the 32-element MX block)


def random_packed(shape_out_in, seed=0):
    """Random packed blocks and scales of a [E, out, in] weight (scales near 2^0, as in checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    e, out, inner = shape_out_in
    blocks = torch.randint(0, 256, (e, out, inner // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(118, 130, (e, out, inner // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers_bitwise():
    blocks, scales = random_packed((E, 2 * F, H))
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # the range's ends (2^-127 subnormal, 2^127)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = dequantize(blocks, scales)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2).contiguous().view(torch.int32), theirs.view(torch.int32))


def test_weights_from_mxfp4_are_fixed_points_of_the_mxfp4_quantizer():
    w = dequantize(*random_packed((E, 2 * F, H), seed=1))
    weight_format = recipe_from_config(FP4Config(format="mxfp4")).weight
    for e in range(E):
        assert torch.equal(fake_quantize(w[e], weight_format), w[e])
    nudged = w[0].clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(float("inf")))  # off the grid: Q moves it
    assert not torch.equal(fake_quantize(nudged, weight_format), nudged)


def test_e8m0_nan_scale_is_refused():
    blocks, scales = random_packed((E, H, F))
    scales[2, 3, 0] = 255
    with pytest.raises(ValueError, match="E8M0 255"):
        dequantize(blocks, scales, "model.layers.0.mlp.experts.down_proj")


def tiny_hf():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=H, intermediate_size=F, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_local_experts=E, num_experts_per_tok=2, sliding_window=4)
        return transformers.GptOssForCausalLM(cfg).float().eval()


def packed_checkpoint(tmp_path):
    """A transformers-written GPT-OSS checkpoint whose expert weights are replaced by packed MXFP4
    tensors (as OpenAI's are), and the dequantized weights transformers itself reads from them."""
    hf = tiny_hf()
    hf.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    expected = {}
    for i in range(2):
        for j, (name, out, inner) in enumerate((("gate_up_proj", 2 * F, H), ("down_proj", H, F))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            del sd[key]
            sd[key + "_blocks"], sd[key + "_scales"] = random_packed((E, out, inner), seed=10 * i + j)
            expected[key] = convert_moe_packed_tensors(sd[key + "_blocks"], sd[key + "_scales"], dtype=torch.float32)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return expected


def test_packed_checkpoint_loads_bitwise_and_exports_back(tmp_path):
    expected = packed_checkpoint(tmp_path / "hf")
    model = build_model_from_hf(tmp_path / "hf", FP4Config(scope="none"))
    sd = to_hf_state_dict(model)
    for key, t in expected.items():
        assert torch.equal(sd[key], t), key
    # written back packed: the same bytes as the input checkpoint's
    save_hf_checkpoint(model, model.cfg, tmp_path / "out", mxfp4_experts=True)
    src, out = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(src) == sorted(out)
    for key in src:
        assert torch.equal(src[key], out[key]), key
    again = build_model_from_hf(tmp_path / "out", FP4Config(scope="none"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_off_grid_weights_are_not_packed():
    hf = tiny_hf()  # random fp32 experts: off the grid
    ours = MoETransformer(ours_config_from_hf(hf.config), FP4Config(scope="none"))
    from_hf_state_dict(ours, hf.state_dict())
    with pytest.raises(ValueError, match="not on the MXFP4 grid"):
        to_hf_state_dict(ours, mxfp4_experts=True)


def test_an_ep_rank_reads_only_its_experts_rows(tmp_path):
    expected = packed_checkpoint(tmp_path)
    tensors = SafetensorsTensors([tmp_path / "model.safetensors"])
    asked = []
    rows = tensors.rows
    tensors.rows = lambda key, lo, hi: asked.append((key, lo, hi)) or rows(key, lo, hi)
    key = "model.layers.1.mlp.experts.down_proj"
    got = read(tensors, key, (E, H, F), (2, 4))
    assert torch.equal(got.transpose(1, 2), expected[key][2:4])
    assert asked == [(key + "_blocks", 2, 4), (key + "_scales", 2, 4)]


def test_header_sizes_are_checked_before_reading(tmp_path):
    packed_checkpoint(tmp_path)
    tensors = SafetensorsTensors([tmp_path / "model.safetensors"])
    tensors.rows = tensors.__getitem__ = None  # any read would fail: only the header may be consulted
    with pytest.raises(ValueError, match=r"uint8 \[4, 128, 2, 16\]"):
        read(tensors, "model.layers.0.mlp.experts.gate_up_proj", (E, 2 * 2 * F, H), (0, E))


def test_load_hf_shard_gives_an_ep_rank_its_experts_rows(tmp_path):
    """An expert-parallel rank's model (experts 2..3 of 4) loads from the packed checkpoint exactly the
    rows of the full model's experts, with the biases."""
    from megatron_fp4.integrations.hf import load_hf_shard
    from megatron_fp4.parallel.moe.expert_parallel import shard_experts

    packed_checkpoint(tmp_path / "hf")
    full = build_model_from_hf(tmp_path / "hf", FP4Config(scope="none"))
    rank = MoETransformer(full.cfg, FP4Config(scope="none"))
    for moe in rank.moe_layers():
        shard_experts(moe, 2, 1)
    load_hf_shard(rank, tmp_path / "hf")
    params = dict(full.named_parameters())
    for name, p in rank.named_parameters():
        want = params[name][2:4] if ".experts." in name else params[name]
        assert torch.equal(p, want), name
