"""Run the vLLM rollout worker (`integrations/vllm/worker.py`) from this environment: in a separate
vLLM environment's python (JSON spec in, JSON + safetensors out, nothing pickled), or in-process
where vllm is importable.

    gens = run_vllm_rollout(spec, work_dir, python=vllm_python(args.vllm_python))
    gens["experts/MoEResQ"]["routing"][i]      # [N, L_moe, k] experts of request i's response tokens

The vLLM python: `python=` (a CLI's `--vllm-python`), else env `MEGATRON_FP4_VLLM_PYTHON`; without
either, vllm must import here.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Optional

ENV_PYTHON = "MEGATRON_FP4_VLLM_PYTHON"
ROOT = Path(__file__).resolve().parents[3]  # the source tree holding megatron_fp4 (PYTHONPATH of the worker)


def vllm_python(explicit: Optional[str] = None) -> Optional[str]:
    """The vLLM environment's python from `explicit` or env MEGATRON_FP4_VLLM_PYTHON (None: neither);
    ValueError when the path named is not an executable file."""
    path = explicit or os.environ.get(ENV_PYTHON) or None
    if path and not (Path(path).is_file() and os.access(path, os.X_OK)):
        src = "--vllm-python" if explicit else ENV_PYTHON
        raise ValueError(f"{src}={path!r} is not an executable python; point it at the vLLM venv's bin/python "
                         f"(tools/vllm_env.sh creates one)")
    return path


MLA_DISABLE = "VLLM_MLA_DISABLE"
MAX_CONFIG_BYTES = 1 << 20  # an export's config.json is a few KB


def family_env(*model_dirs) -> dict:
    """What a vLLM process serving these exports needs in its environment before vLLM builds its
    config: ``VLLM_MLA_DISABLE=1`` when one is DeepSeek-V3 (``model_type`` deepseek_v3 in its
    config.json: vLLM's non-MLA attention over the standard paged cache, the one the plugin serves,
    mla.py); {} otherwise. For the launchers to put in their child's environment, never this one's."""
    for d in model_dirs:
        path = Path(d) / "config.json"
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path} is {path.stat().st_size} bytes, not an HF config.json (at most "
                             f"{MAX_CONFIG_BYTES}): point the launcher at an export_for_vllm directory")
        if json.loads(path.read_text()).get("model_type") == "deepseek_v3":
            return {MLA_DISABLE: "1"}
    return {}


def worker_env(*model_dirs) -> dict:
    """The environment of a vLLM process this project starts (a copy of this one's, which is left
    as it is), serving the exports ``model_dirs`` (`family_env`)."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), **family_env(*model_dirs)})
    return env


def run_vllm_rollout(spec: dict, work_dir, python: Optional[str] = None, timeout: float = 3600) -> dict:
    """{job name: {"tokens", "logprobs" (list of [N] tensors), "routing", "dist" (lists; None when not
    asked), "plugin"}} of `spec` (worker module doc) run by `python` or in-process."""
    from megatron_fp4.integrations.vllm import vllm_available

    work_dir = Path(work_dir)
    out_dir = work_dir / "vllm_out"
    work_dir.mkdir(parents=True, exist_ok=True)
    if python:
        (work_dir / "vllm_spec.json").write_text(json.dumps(spec))
        env = worker_env(*(job["model"] for job in spec["jobs"]))  # what the exports' families need (family_env)
        run = subprocess.run([python, "-m", "megatron_fp4.integrations.vllm.worker", str(work_dir / "vllm_spec.json"),
                              str(out_dir)], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
        if run.returncode != 0:
            raise RuntimeError(f"vLLM worker ({python}) failed with exit {run.returncode}:\n{run.stderr[-3000:]}")
    else:
        cap = vllm_available()
        if not cap:
            raise RuntimeError(f"vLLM rollout: {cap.reason}; pass --vllm-python / set {ENV_PYTHON} to the vLLM venv's "
                               f"python (tools/vllm_env.sh)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from megatron_fp4.integrations.vllm.worker import run_spec

        run_spec(spec, out_dir)
    return load_results(out_dir, len(spec["prompts"]))


def load_results(out_dir, num_prompts: int) -> dict:
    import torch
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    jobs = json.loads((out_dir / "results.json").read_text())["jobs"]
    out = {}
    for name, res in jobs.items():
        tensors = load_file(str(out_dir / res["file"]))
        if len(res["tokens"]) != num_prompts:
            raise ValueError(f"{out_dir}: job {name!r} returned {len(res['tokens'])} requests, expected {num_prompts}")
        get = lambda key: [tensors[f"{key}.{i}"] for i in range(num_prompts)] if f"{key}.0" in tensors else None  # noqa: E731
        out[name] = {"tokens": res["tokens"], "plugin": res["plugin"], "routing": get("routing"), "dist": get("dist"),
                     "logprobs": [torch.tensor(lp, dtype=torch.float32) for lp in res["logprobs"]]}
    return out


__all__ = ["ENV_PYTHON", "vllm_python", "run_vllm_rollout", "load_results", "worker_env", "family_env"]
