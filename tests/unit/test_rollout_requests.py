"""Bad generation requests are refused at the request with a line naming the field, before the
forward (token ids outside the vocabulary used to raise IndexError from the embedding, a 1e-45
temperature "probability tensor contains inf/nan" from the sampler)."""
import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.rollout.sampling import MIN_TEMPERATURE


def _engine():
    cfg = Config()
    assert cfg.model.vocab_size == 32
    return RolloutEngine(build_model(cfg, seed=7), mode="bf16")


@pytest.mark.parametrize("prompt, match", [([1, 999], r"prompt 1: token id 999 is outside the model's vocabulary "
                                                      r"\[0, 32\) \(model.vocab_size\)"),
                                           ([-3, 4], r"token id -3 is outside"), ([32], r"token id 32 is outside"),
                                           ([1, 2.5], "not an integer token id"), ([1, "7"], "not an integer token id"),
                                           ([torch.tensor(1.0)], "not an integer token id")])
def test_token_ids_outside_the_vocabulary_are_refused_at_the_request(prompt, match):
    with pytest.raises(ValueError, match=match):
        _engine().generate([[1, 2], prompt], SamplingParams(max_new_tokens=2))


def test_integer_token_ids_of_any_integer_type_are_taken():
    engine = _engine()
    plain = engine.generate([[1, 31]], SamplingParams(max_new_tokens=2, temperature=0))
    tensor = engine.generate([torch.tensor([1, 31])], SamplingParams(max_new_tokens=2, temperature=0))
    assert plain.response_ids == tensor.response_ids


@pytest.mark.parametrize("field, value", [("temperature", 1e-45), ("temperature", MIN_TEMPERATURE / 2),
                                          ("temperature", float("inf")), ("temperature", float("nan")),
                                          ("temperature", "1"), ("top_p", "0.5"), ("top_k", True), ("seed", 2 ** 64),
                                          ("seed", 1.5), ("stop_token_ids", ["x"]), ("stop_token_ids", [2.0])])
def test_sampling_parameters_are_refused_at_construction(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_the_smallest_temperature_allowed_samples_finite_log_probs():
    out = _engine().generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=MIN_TEMPERATURE, seed=1))
    assert len(out.response_ids[0]) == 4
    assert torch.isfinite(torch.as_tensor(out.log_probs[0])).all()
    assert torch.isfinite(torch.as_tensor(out.sampled_log_probs[0])).all()
