"""The project's vLLM launchers put what the export's family needs into the environment of the vLLM
process they start, not into their own: ``VLLM_MLA_DISABLE=1`` for DeepSeek-V3 (vLLM's non-MLA
attention, which the plugin serves; integrations/vllm/mla.py), nothing for Qwen3-MoE.

No vLLM needed: each launcher starts a stand-in "python" (a shell script) that writes the
environment it was given and exits; the end-to-end start of a DeepSeek-V3 export is in
tests/integration/test_vllm_plugin_families.py."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from megatron_fp4.config import Config, ModelConfig
from megatron_fp4.integrations.vllm.remote import MLA_DISABLE, family_env, run_vllm_rollout, worker_env


def export_dir(tmp_path, model_type: str):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


def fake_python(tmp_path, code: int = 0):
    """An executable that writes its environment to ENV.json and exits with `code`."""
    out = tmp_path / "ENV.json"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{sys.executable} -c 'import json, os; "
                      f"open(\"{out}\", \"w\").write(json.dumps(dict(os.environ)))'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), out


@pytest.fixture(autouse=True)
def no_user_setting(monkeypatch):
    monkeypatch.delenv(MLA_DISABLE, raising=False)


def test_family_env_names_mla_disable_for_deepseek_v3_only(tmp_path):
    ds, qwen = export_dir(tmp_path, "deepseek_v3"), export_dir(tmp_path, "qwen3_moe")
    assert family_env(ds) == {MLA_DISABLE: "1"} and family_env(qwen) == {}
    assert family_env(qwen, ds) == {MLA_DISABLE: "1"}
    assert worker_env(ds)[MLA_DISABLE] == "1" and MLA_DISABLE not in worker_env(qwen)
    assert MLA_DISABLE not in os.environ  # the caller's environment is left as it is
    big = export_dir(tmp_path, "x")
    (big / "config.json").write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="not an HF config.json"):
        family_env(big)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_vllm_serve_launcher_sets_it_in_the_servers_environment(tmp_path, model_type):
    from megatron_fp4.integrations.vllm.serve import start_vllm_server

    python, out = fake_python(tmp_path)
    server = start_vllm_server(export_dir(tmp_path, model_type), python, "t" * 64, wait=False, log=tmp_path / "log")
    assert server.proc.wait(60) == 0
    env = json.loads(out.read_text())
    assert env.get(MLA_DISABLE) == ("1" if model_type == "deepseek_v3" else None)
    assert MLA_DISABLE not in os.environ


def test_vllm_worker_launcher_sets_it_in_the_workers_environment(tmp_path):
    python, out = fake_python(tmp_path, code=3)
    spec = {"jobs": [{"name": "a", "model": str(export_dir(tmp_path, "deepseek_v3"))}], "prompts": [[1, 2]]}
    with pytest.raises(RuntimeError, match="failed with exit"):  # the stand-in generates nothing
        run_vllm_rollout(spec, tmp_path / "work", python=python)
    assert json.loads(out.read_text())[MLA_DISABLE] == "1" and MLA_DISABLE not in os.environ


def test_vllm_rollout_launcher_sets_it_in_the_rollout_servers_environment(tmp_path, monkeypatch):
    """`--rollout vllm`'s launch (VLLMRollout: the rollout server process) for a DeepSeek-V3 config."""
    from megatron_fp4.rl.rollouts.client import RemoteRollout
    from megatron_fp4.rl.rollouts.vllm import VLLMRollout

    cfg = Config()
    cfg.model = ModelConfig(vocab_size=32, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32,
                            num_experts=4, top_k=1, moe_ffn_hidden_size=16, family="deepseek_v3", q_lora_rank=24,
                            kv_lora_rank=20, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=8)
    seen = {}
    monkeypatch.setattr(RemoteRollout, "_start", lambda self, *a: seen.setdefault("launch", a[-1]))
    python, _ = fake_python(tmp_path)
    VLLMRollout(type("Trainer", (), {"cfg": cfg})(), pad_id=0, work_dir=tmp_path / "vllm", python=python)
    _, module, spec, env = seen["launch"]()
    assert module == "megatron_fp4.rl.rollouts.vllm_server" and env[MLA_DISABLE] == "1"
    assert json.loads((tmp_path / "vllm" / "hf" / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert MLA_DISABLE not in os.environ


@pytest.mark.parametrize("kind", ["vllm", "vllm-serve"])
def test_a_dtype_vllm_does_not_serve_is_refused_before_anything_starts(kind):
    from types import SimpleNamespace

    from megatron_fp4.rl.rollouts.vllm import VLLMRollout, VLLMServeRollout, served_dtype

    trainer = SimpleNamespace(cfg=SimpleNamespace(dtype="fp64"))
    cls = VLLMRollout if kind == "vllm" else VLLMServeRollout
    with pytest.raises(ValueError, match=f"--rollout {kind}: dtype 'fp64' is not served"):
        cls(trainer, pad_id=0)
    assert served_dtype(SimpleNamespace(dtype="bf16"), kind) == "bfloat16"
