"""The hf engine's own decoding loop: its sampler draws from the right distribution, and greedy
decoding gives transformers' ``generate`` tokens."""

import torch

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.engines.hf.sampling import next_tokens, sample_tokens
from r3lightning.rollout.chat import ChatFormatter

DRAWS = 40_000


def _frequencies(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = sample_tokens(logits.expand(DRAWS, -1), temperature, top_p, top_k=top_k, min_p=min_p)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / DRAWS


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    for temperature in (1.0, 0.5, 2.0):
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        # 4 standard deviations of a frequency over 40k draws is at most 0.01
        torch.testing.assert_close(_frequencies(logits, temperature), expected, atol=0.01, rtol=0)


def test_top_p_keeps_the_nucleus_renormalized():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    # Mass before each token in order of probability: 0, 0.5, 0.8, 0.95; top_p 0.7 keeps the first two.
    frequencies = _frequencies(probs.log(), 1.0, top_p=0.7)
    assert frequencies[1] == 0 and frequencies[3] == 0
    torch.testing.assert_close(frequencies, torch.tensor([0.625, 0.0, 0.375, 0.0]), atol=0.01, rtol=0)
    # A top_p below the most likely token's mass keeps that token alone.
    assert torch.equal(_frequencies(probs.log(), 1.0, top_p=0.1), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_k_and_min_p_keep_their_tokens_renormalized():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    # top_k 2 keeps 0.5 and 0.3: 0.625 / 0.375.
    torch.testing.assert_close(_frequencies(probs.log(), 1.0, top_k=2), torch.tensor([0.625, 0.0, 0.375, 0.0]), atol=0.01, rtol=0)
    # min_p 0.25 keeps tokens with p >= 0.125: 0.5, 0.3, 0.15 (sum 0.95).
    torch.testing.assert_close(
        _frequencies(probs.log(), 1.0, min_p=0.25), torch.tensor([0.5, 0.0, 0.3, 0.15]) / 0.95, atol=0.01, rtol=0
    )
    # top_k 3 leaves 0.95; top_p 0.6 of that (0.57) is reached after 0.5 + 0.3: 0.625 / 0.375.
    torch.testing.assert_close(
        _frequencies(probs.log(), 1.0, top_p=0.6, top_k=3), torch.tensor([0.625, 0.0, 0.375, 0.0]), atol=0.01, rtol=0
    )
    # top_k at or above the vocabulary size truncates nothing.
    torch.testing.assert_close(_frequencies(probs.log(), 1.0, top_k=4), probs[0], atol=0.01, rtol=0)


def test_behaviour_logprob_is_the_whole_tempered_softmax_under_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(64, -1)
    torch.manual_seed(0)
    tokens, logprobs = next_tokens(logits, 0.5, 0.9, None, top_k=2, min_p=0.1)
    assert set(tokens.tolist()) <= {0, 1}
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / 0.5, dim=-1).gather(-1, tokens[:, None])[:, 0])


def test_sampling_params_refuse_bad_truncation():
    import pytest

    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\)"):
        SamplingParams(min_p=1.0)


def test_impossible_tokens_are_never_drawn_and_a_seed_repeats():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]])
    frequencies = _frequencies(logits, 1.0)
    assert frequencies[[0, 2, 4]].sum() == 0 and abs(float(frequencies[1]) - 0.5) < 0.01
    torch.manual_seed(3)
    first = sample_tokens(torch.randn(16, 50), 1.0)
    torch.manual_seed(3)
    assert torch.equal(sample_tokens(torch.randn(16, 50), 1.0), first)


def test_greedy_decoding_equals_transformers_generate(world_tokenizer, world_policy):
    chat = ChatFormatter(world_tokenizer)
    prompts = [chat.first_prompt(t) for t in ("Your task: put the apple on the desk.", "Valid actions: look", "take")]
    engine = HFEngine(world_policy, world_tokenizer, prefix_cache=False)
    generations = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, gen in zip(prompts, generations):
        with torch.no_grad():
            out = world_policy.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=12, eos_token_id=world_tokenizer.eos_token_id,
                pad_token_id=world_tokenizer.pad_token_id,
            )
        expected = out[0, len(prompt) :].tolist()
        if world_tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(world_tokenizer.eos_token_id) + 1]
        assert gen.token_ids == expected
