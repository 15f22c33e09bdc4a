"""What the model-family parity tests (test_gpt_oss_parity.py, test_deepseek_v3_parity.py) share:
a random HF model's weights, our model from it, the comparison, and HF's RMSNorm in the model's
dtype for the fp64 comparison (HF's family norms compute in fp32 whatever the model dtype; our fp64
verification mode keeps fp64)."""
from __future__ import annotations

import warnings

import torch

from megatron_fp4.config import FP4Config
from megatron_fp4.integrations.hf import from_hf_state_dict, ours_config_from_hf
from megatron_fp4.model import MoETransformer


def random_hf(cls, config, dtype, seed: int, buffers=()):
    """`cls(config)` with eager experts (HF's grouped_mm path has no fp64) and seeded weights: norms
    1 + 0.1·noise, everything else 0.3·noise (norms away from 1, a peaked router and nonzero biases
    all matter); buffers whose names end with one of `buffers` get 0.2·noise."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config)
    model.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
        for name, b in model.named_buffers():
            if buffers and name.endswith(tuple(buffers)):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model.to(dtype).eval()


def ours_from(hf, fp4_cfg=None):
    """Our model of `hf`'s config (the family from its model_type) holding `hf`'s weights."""
    model = MoETransformer(ours_config_from_hf(hf.config), fp4_cfg or FP4Config(scope="none"))
    model = model.to(next(hf.parameters()).dtype)
    from_hf_state_dict(model, hf.state_dict())
    return model.eval()


def rel_err(ours, ref) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def logits(model, tokens, **kw):
    with torch.no_grad():
        return model(tokens, **kw).logits if isinstance(model, MoETransformer) else model(input_ids=tokens).logits


def norm_in_model_dtype(monkeypatch, norm_cls) -> None:
    """`norm_cls.forward` = HF's RMSNorm formula in the input's dtype (for the fp64 comparison)."""
    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(norm_cls, "forward", forward)


def cli_round_trip_is_bitwise(hf, tmp_path, capsys, family: str) -> None:
    """`hf` saved by transformers -> `convert_checkpoint from-hf` (our DCP, the family from
    config.json) -> `to-hf`: the same tensors, bit for bit; `inspect` names the family."""
    import json

    from safetensors.torch import load_file

    from tools.convert_checkpoint import main as convert_main

    hf.save_pretrained(tmp_path / "hf")
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert convert_main(["inspect", str(tmp_path / "ours")]) == 0
    assert f"model: {family}" in capsys.readouterr().out
    assert convert_main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    src, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(src) == sorted(back)
    assert all(torch.equal(src[k], back[k]) for k in src)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == family
