import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from r3lightning.data.datamodule import corpus_from_suite
from r3lightning.models import TinyModelSpec, build_tiny_model, build_tokenizer
from r3lightning.rollout.agent_loop import AgentLoopConfig

TINY_SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)


@pytest.fixture(scope="session")
def world_suite():
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite

    return ProceduralWorldSuite(difficulty=1, num_val_tasks=8, max_turns=4)


@pytest.fixture(scope="session")
def world_tokenizer(world_suite):
    return build_tokenizer(corpus_from_suite(world_suite, AgentLoopConfig(), num_tasks=16), vocab_size=TINY_SPEC.vocab_size)


@pytest.fixture()
def world_policy(world_tokenizer):
    return build_tiny_model(TINY_SPEC, world_tokenizer, seed=0)
