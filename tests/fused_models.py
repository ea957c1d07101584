"""Models and runs shared by the fused decoding tests (tests/engines/test_fused_decode.py and
test_compiled_decode.py): small llama-family models covering the fused step's branches, and a two-call
generation that exercises padding, shared prompts and prefix-cache hits."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from r3lightning.training.models import TinyModelSpec, build_tiny_model
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine


def small_model(config_class, model_class, tokenizer, **extra):
    torch.manual_seed(0)
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **extra,
    )
    return model_class(config)


def _eager(model):
    model.config._attn_implementation = "eager"  # transformers' eager attention for the prefill and the reference
    return model


def family_models(tokenizer):
    return {
        "qwen2": build_tiny_model(TinyModelSpec(), tokenizer, seed=0),
        "qwen2_eager_attention": _eager(build_tiny_model(TinyModelSpec(), tokenizer, seed=0)),
        # Llama with biases on every projection and a llama3 rotary scaling (rescaled inverse frequencies).
        "llama": small_model(LlamaConfig, LlamaForCausalLM, tokenizer, attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }),
        # Per-head q/k norms, and yarn rotary scaling (cos and sin scaled by its attention factor).
        "qwen3": small_model(Qwen3Config, Qwen3ForCausalLM, tokenizer, max_position_embeddings=128, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        }),
    }


def chat_prompts(tokenizer, shared: bool = True):
    chat = ChatFormatter(tokenizer)
    texts = ["Your task: put the apple on the desk.", "Valid actions: look", "take mug", "go to desk 1 and look around"]
    prompts = [chat.first_prompt(t) for t in texts]
    return prompts + [prompts[0]] * 3 if shared else prompts  # a shared prompt is encoded once


def run_two_calls(model, tokenizer, decode: str, params: SamplingParams, seed: int = 0, shared: bool = True, **engine_options):
    """Two calls: fresh prompts, then each prompt extended by its completion and more tokens. With
    a fused ``decode`` the second call hits the prefix cache (prefixes of different lengths, so rows are padded in
    the middle); the reference recomputes every prompt with the model's forward. Without ``shared``
    prompts the first call prefills every row from an empty cache. ``engine_options`` go to ``HFEngine``."""
    fused = decode != "forward"
    engine = HFEngine(model, tokenizer, decode=decode, prefix_cache=fused, **engine_options)
    engine.stop_token_ids = {-1}  # decode the whole budget: every step compared
    torch.manual_seed(seed)
    prompts = chat_prompts(tokenizer, shared)
    first = engine.generate(prompts, params)
    follow = [p + g.token_ids + p[-3:] for p, g in zip(prompts, first)]
    second = engine.generate(follow, params)
    assert engine.cache_hit_rate() > 0.3 or not fused
    return engine, first + second
