"""benchmarks/decode_floor.py: its matmul replay runs the very matmuls of an eager decoding step, and the
FLOP count it uses (``decode_step_flops`` without attention) is theirs, so the floor it reports bounds that step."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.decode_floor import step_matmuls
from benchmarks.rollout_throughput import decode_step_flops
from r3lightning.engines.hf.fused_step import FusedDecoder
from r3lightning.engines.hf.kv_cache import growing_cache

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class MatmulRecorder(TorchDispatchMode):
    """(op, [M, K, N]) of every mm / addmm dispatched inside the mode."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            left, right = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
            self.calls[(func.__name__, (left.shape[0], left.shape[1], right.shape[1]))] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def decoder():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    fused = FusedDecoder(model)
    fused.refresh(("test",))
    return fused


@pytest.mark.parametrize("rows", [1, 5])
def test_the_replay_runs_the_decoding_steps_matmuls_with_their_shapes(decoder, rows):
    cache = growing_cache(8)
    with torch.no_grad():
        decoder.prefill(torch.randint(0, 50, (rows, 3)), torch.arange(3).expand(rows, 3), cache, torch.ones(rows, 3, dtype=torch.long))
        with MatmulRecorder() as in_step:
            decoder.step(torch.randint(0, 50, (rows,)), torch.full((rows,), 3), cache, torch.zeros(rows, 1, 1, 4))
        with MatmulRecorder() as in_replay:
            step_matmuls(decoder, rows)()
    assert in_replay.calls == in_step.calls
    # qwen2: biased q/k/v (addmm), o and down added to the residual (addmm), gate/up and the tied head (mm).
    assert sum(in_step.calls.values()) == 4 * 2 + 1


def test_the_flop_count_is_the_replayed_matmuls(decoder):
    with MatmulRecorder() as recorder, torch.no_grad():
        step_matmuls(decoder, 7)()
    counted = sum(2 * m * k * n * times for (_, (m, k, n)), times in recorder.calls.items())
    assert decode_step_flops(decoder.model, 7, context=0) == counted
