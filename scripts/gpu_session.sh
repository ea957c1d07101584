#!/usr/bin/env bash
# One GPU session's checks, run as a single script on a machine with one CUDA device (the project's
# tests never need one). From the repository root:
#
#   OUT=/tmp/out bash scripts/gpu_session.sh
#
# 1. The CUDA tests (tests/gpu: prefix-cached hf engine in fp32/bf16, an SFT -> R3L fit in fp32 and
#    bf16-mixed) -> $OUT/gpu_tests.log
# 2. Rollout throughput of the hf engine (and vLLM's, when vllm is importable there) on a random-init
#    Qwen2-0.5B-shaped model -> $OUT/rollout_throughput_gpu.json
# 3. Training-update throughput (ours vs a plain PyTorch loop) on a ~100M-parameter model, fp32
#    -> $OUT/train_throughput_gpu.json
# 4. The hf engine's decoding at batch 128 on the 0.5B shape, eager vs compiled (static KV cache +
#    CUDA graphs), and bf16-mixed training throughput with MFU on ~100M parameters
#    -> $OUT/gpu_throughput.json
#
# Uses the machine's own python3 and packages (torch with CUDA, transformers, lightning; nothing is
# installed). About 8 minutes on an H200 (the compiled decoding compiles for a minute or two).
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
PY=${PYTHON:-python3}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, transformers, lightning; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'lightning', lightning.__version__)"

echo "== 1. CUDA tests"
timeout 180 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15 || status=1

echo "== 2. rollout throughput"
timeout 200 "$PY" -m benchmarks.rollout_throughput --preset gpu-0.5b --no-enforce-eager \
  --gpu-memory-utilization 0.3 --out "$OUT/rollout_throughput_gpu.json" 2>&1 | grep -v "INFO\|WARNING\|it/s\]" | tail -n 30 || status=1

echo "== 3. train throughput"
timeout 150 "$PY" -m benchmarks.train_throughput --accelerator gpu --target-params 100000000 --hidden-size 1024 --batch-size 64 \
  --seq-len 512 --micro-batch-size 16 --repeats 5 --out "$OUT/train_throughput_gpu.json" 2>&1 | tail -n 25 || status=1

echo "== 4. compiled decoding and bf16-mixed MFU"
timeout 240 "$PY" -m benchmarks.gpu_throughput --out "$OUT/gpu_throughput.json" 2>&1 | tail -n 25 || status=1
exit $status
