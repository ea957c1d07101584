"""The hf engine's compiled path (static KV cache, torch.compile of the decoding step, bucketed shapes)
against the eager path. The ``eager`` backend traces the same graphs as inductor in seconds, so these
tests stay fast on CPU; the inductor and CUDA-graph modes are measured by the benchmarks."""

import torch

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.engines.hf.generate_compiled import CompiledGenerate
from r3lightning.rollout.chat import ChatFormatter


def _prompts(tokenizer, n: int = 5):
    texts = ["Your task: put the apple on the desk.", "Valid actions: look", "take mug", "go north", "open the box"]
    chat = ChatFormatter(tokenizer)
    return [chat.first_prompt(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)]


def _compiled(policy, tokenizer, **kwargs) -> HFEngine:
    return HFEngine(policy, tokenizer, max_batch_size=16, decode="generate_compiled", compile_backend="eager", **kwargs)


def _assert_same(eager, compiled) -> None:
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    assert [g.finish_reason for g in compiled] == [g.finish_reason for g in eager]
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_compiled_greedy_equals_eager_and_prefix_cache_keeps_working(world_tokenizer, world_policy):
    eager = HFEngine(world_policy, world_tokenizer, max_batch_size=16)
    compiled = _compiled(world_policy, world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = _prompts(world_tokenizer)
    for turn in range(3):  # later turns extend earlier ones: the prefix cache serves their prefixes
        a, b = eager.generate(prompts, params), compiled.generate(prompts, params)
        _assert_same(a, b)
        observation = world_tokenizer("\nok, next", add_special_tokens=False)["input_ids"]
        prompts = [p + g.token_ids + observation for p, g in zip(prompts, a)]
    assert compiled.stats["reused_prompt_tokens"] == eager.stats["reused_prompt_tokens"] > 0
    assert compiled.cache_hit_rate() == eager.cache_hit_rate()
    # 5 prompts pad to a batch of 8; lengths fall in few power-of-two buckets.
    assert {batch for batch, _ in compiled.compiled_generate.first_call_s} == {8}
    assert len(compiled.compiled_generate.first_call_s) <= 2
    stats = compiled.compile_stats()
    assert stats["compile"] and stats["buckets"] and "perf/hf_compiled_buckets" in compiled.metrics()


def test_compiled_sampled_logprobs_match_eager_scoring(world_tokenizer, world_policy):
    """Sampled tokens differ (padded rows draw random numbers too), but every log-prob is the eager
    engine's (and the trainer's) value for the tokens drawn."""
    from r3lightning.algos import selective_log_softmax

    torch.manual_seed(0)
    compiled = _compiled(world_policy, world_tokenizer, compile_mode="default")
    prompts = _prompts(world_tokenizer, 3)
    for prompt, gen in zip(prompts, compiled.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=8))):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = world_policy(input_ids=ids).logits[:, :-1] / 0.7
        recomputed = selective_log_softmax(logits, ids[:, 1:])[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(gen.logprobs), recomputed, atol=1e-5, rtol=0)


def test_batch_and_length_buckets(world_tokenizer, world_policy):
    compiled = HFEngine(world_policy, world_tokenizer, max_batch_size=48, decode="generate_compiled").compiled_generate
    assert [compiled.batch_bucket(n) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    assert [CompiledGenerate.length_bucket(n) for n in (1, 64, 65, 200, 1025)] == [64, 64, 128, 256, 2048]


def test_compiled_path_generates_under_bf16_autocast(world_tokenizer, world_policy):
    """Under autocast (bf16-mixed training: the rollout runs inside the training step) a Qwen2 layer's
    keys come out float32 and its values bfloat16, which a one-dtype StaticCache rejects; the compiled
    path decodes without autocast, in the parameters' dtype, as eagerly without autocast."""
    eager = HFEngine(world_policy, world_tokenizer, max_batch_size=16)
    compiled = _compiled(world_policy, world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = _prompts(world_tokenizer, 3)
    expected = eager.generate(prompts, params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(expected, compiled.generate(prompts, params))
