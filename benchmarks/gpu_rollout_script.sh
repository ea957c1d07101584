#!/usr/bin/env bash
# Rollout throughput (hf vs vllm engines at batch 8/32/128) and weight-sync time vs model size on one
# GPU, with a random-init Qwen2-0.5B-shaped model (hidden 896, 24 layers, vocab 151936; built from a
# config, nothing downloaded). Writes $OUT/rollout_throughput_gpu.json (and a log beside it).
#
#   OUT=/tmp/out bash benchmarks/gpu_rollout_script.sh          # from the repository root
#
# Needs torch with CUDA, transformers, lightning, peft (r3lightning's dependencies) and vllm. vllm is
# installed with pip when missing, which needs a package index; on a machine without one, install
# it beforehand. Expected run time: about 5 minutes (the first vLLM start compiles and captures
# CUDA graphs; the sync sweep starts three more engines in eager mode).
set -uo pipefail
OUT=${OUT:-$PWD/benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/rollout_throughput_gpu.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0
PY=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  if ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "vllm missing: pip install vllm"
    "$PY" -m pip install --quiet "vllm>=0.10" || echo "pip install vllm failed"
  fi
  "$PY" -c "import torch, vllm, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
} >"$LOG" 2>&1

if ! "$PY" -c "import vllm" >>"$LOG" 2>&1; then
  printf '{"benchmark": "rollout_throughput", "figures": {}, "config": {"preset": "gpu-0.5b", "errors": ["vllm not importable; see rollout_throughput_gpu.log"]}, "machine": {}}\n' \
    >"$OUT/rollout_throughput_gpu.json"
  tail -20 "$LOG"
  exit 1
fi

timeout 540 "$PY" benchmarks/rollout_throughput.py --preset gpu-0.5b --no-enforce-eager \
  --gpu-memory-utilization 0.3 --out "$OUT/rollout_throughput_gpu.json" >>"$LOG" 2>&1
rc=$?
grep -v "INFO\|WARNING\|it/s\]" "$LOG" | tail -40
exit $rc
