"""Run by test_compile_cache.py in a fresh process: one greedy call of the tiny policy with inductor's
compiled fused step and the given cache directory; prints the engine's cache figures as JSON."""

import json
import sys

import torch

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.training.models import TinyModelSpec, build_tiny_model, build_tokenizer

cache_dir, layers = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
tokenizer = build_tokenizer(["go north", "take the key", "open the door"], vocab_size=300)
model = build_tiny_model(TinyModelSpec(num_layers=layers), tokenizer, seed=0)
engine = HFEngine(model, tokenizer, decode="fused_compiled", compile_cache_dir=cache_dir)
engine.generate([tokenizer.encode("go north")] * 2, SamplingParams(temperature=0.0, max_new_tokens=3))
print(json.dumps({k: v for k, v in engine.metrics().items() if "compile" in k}))
