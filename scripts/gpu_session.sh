#!/usr/bin/env bash
# One GPU session's checks, run as a single script on a machine with one CUDA device (the project's
# tests never need one). From the repository root:
#
#   OUT=/tmp/out bash scripts/gpu_session.sh
#
# In order of what a session can least afford to lose, each part under its own time limit and
# writing its own file as soon as it ends:
# 1. The CUDA tests (tests/gpu: prefix-cached hf engine in fp32/bf16, an SFT -> R3L fit in fp32 and
#    bf16-mixed) -> $OUT/gpu_tests.log
# 2. bf16-mixed training throughput with MFU at ~100M and ~0.5B parameters -> $OUT/gpu_training.json
# 3. 20 RL steps of configs/recipes/r3l_math_qwen2.5-1.5b.yaml shrunk by benchmarks/recipe_gpu_override.yaml
#    (random-init 82M model, hf engine), every logged scalar -> $OUT/recipe_gpu_r3l_math.json
# 4. The hf engine's decoding at batch 128 on the Qwen2-0.5B shape, eager vs compiled (static KV cache
#    + CUDA graphs; the fused step compiled) -> $OUT/gpu_rollout.json
# 5. vLLM's step time and weight-sync bandwidth (benchmarks/rollout_throughput.py) when vllm imports
#    there; otherwise $OUT/vllm_gpu.json says why not.
#
# Uses the machine's own python3 and packages (torch with CUDA, transformers, lightning). Packages it
# lacks (jsonargparse, reasoning-gym, math-verify and their needs) travel as wheels in .whl/ and are
# installed into /tmp/site first when that folder is there. About 8 minutes on an H200.
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# Not installed there: the top-level callbacks/ folder is the package's r3lightning.callbacks only once
# installed (pyproject's package-dir), so the checkout gets the link the install would make.
[ -e r3lightning/callbacks ] || ln -s ../callbacks r3lightning/callbacks
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, transformers, lightning; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'lightning', lightning.__version__)"

echo "== 1. CUDA tests"
timeout 90 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 12 || status=1

echo "== 2. bf16-mixed training MFU"
timeout 120 "$PY" -m benchmarks.gpu_throughput --parts training --out "$OUT/gpu_training.json" 2>&1 | tail -n 20 || status=1

echo "== 3. 20 steps of the R3L math recipe"
timeout 180 "$PY" -m benchmarks.recipe_run --out "$OUT/recipe_gpu_r3l_math.json" \
  --config configs/recipes/r3l_math_qwen2.5-1.5b.yaml --config benchmarks/recipe_gpu_override.yaml 2>&1 | tail -n 15 || status=1

echo "== 4. compiled decoding"
timeout 170 "$PY" -m benchmarks.gpu_throughput --parts rollout --repeats 3 --out "$OUT/gpu_rollout.json" 2>&1 | tail -n 25 || status=1

echo "== 5. vLLM"
if "$PY" -c "import vllm" 2>/dev/null; then
  timeout 120 "$PY" -m benchmarks.rollout_throughput --preset gpu-0.5b --no-enforce-eager \
    --gpu-memory-utilization 0.3 --out "$OUT/vllm_gpu.json" 2>&1 | grep -v "INFO\|WARNING\|it/s\]" | tail -n 20 || status=1
else
  reason=$("$PY" -c "import vllm" 2>&1 | tail -n 1)
  "$PY" -c "import json, sys; json.dump({'benchmark': 'vllm_gpu', 'figures': 'not run: vllm does not import on this machine', 'config': {'import_error': sys.argv[1]}, 'machine': {}}, open(sys.argv[2], 'w'), indent=2)" "$reason" "$OUT/vllm_gpu.json"
  echo "vllm: not run ($reason)"
fi
exit $status
