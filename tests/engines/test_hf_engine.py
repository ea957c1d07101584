"""The hf engine: batched sampling on the live policy with behaviour log-probs."""

from array import array

import pytest
import torch

from r3lightning.algos import selective_log_softmax
from r3lightning.engines.base import SamplingParams, truncate_at_stop
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.engines.hf.kv_cache import PrefixKVCache, batch_inputs, long_tensor
from r3lightning.engines.hf.fused_step import FusedDecoder
from r3lightning.rollout.chat import ChatFormatter


def _prompts(tokenizer):
    texts = ["Your task: put the apple on the desk.", "Valid actions: look", "take mug"]
    chat = ChatFormatter(tokenizer)
    return [chat.first_prompt(t) for t in texts]


def test_greedy_is_deterministic_and_batch_independent(world_tokenizer, world_policy):
    engine = HFEngine(world_policy, world_tokenizer)
    prompts = _prompts(world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    batched = engine.generate(prompts, params)
    single = [engine.generate([p], params)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    assert all(len(g.token_ids) == len(g.logprobs) for g in batched)


def test_logprobs_match_trainer_recomputation(world_tokenizer, world_policy):
    torch.manual_seed(0)
    engine = HFEngine(world_policy, world_tokenizer)
    prompts = _prompts(world_tokenizer)
    params = SamplingParams(temperature=0.7, max_new_tokens=8)
    for prompt, gen in zip(prompts, engine.generate(prompts, params)):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = world_policy(input_ids=ids).logits[:, :-1] / 0.7
        recomputed = selective_log_softmax(logits, ids[:, 1:])[0, len(prompt) - 1 :]
        torch.testing.assert_close(recomputed, torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_batch_of_groups_draws_its_first_tokens_from_the_shared_prefill(world_tokenizer, world_policy, monkeypatch, fused):
    """Every prompt repeated (a GRPO batch, prompts of different lengths): the prompts are encoded whole
    once and the first tokens drawn from those logits, so decoding takes one step fewer over the whole
    batch; tokens and behaviour log-probs are those of the forward (greedy: of each prompt alone), with
    the fused step and with the model's forward decoding."""
    steps = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, *args: steps.append(1) or step(self, *args))
    engine = HFEngine(world_policy, world_tokenizer, decode="fused" if fused else "forward")
    engine.stop_token_ids = {-1}  # every row decodes the whole budget
    prompts = [prompt for prompt in _prompts(world_tokenizer) for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    batched = engine.generate(prompts, greedy)
    assert len(steps) == (greedy.max_new_tokens - 1 if fused else 0)
    single = [engine.generate([p], greedy)[0] for p in prompts[::3]]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single for _ in range(3)]
    # Next turns whose prompts continue the single calls' sequences: each group continues a prefix-cache hit.
    follow = [p + g.token_ids + p[-3:] for p, g in zip(prompts[::3], single) for _ in range(3)]
    reused = engine.stats["reused_prompt_tokens"]
    continued = engine.generate(follow, greedy)
    assert engine.stats["reused_prompt_tokens"] > reused
    fresh = HFEngine(world_policy, world_tokenizer, prefix_cache=False, decode="fused" if fused else "forward")
    fresh.stop_token_ids = {-1}
    assert [g.token_ids for g in continued] == [fresh.generate([p], greedy)[0].token_ids for p in follow]
    torch.manual_seed(0)
    for prompt, gen in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=6))):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = world_policy(input_ids=ids).logits[:, :-1] / 0.7
        recomputed = selective_log_softmax(logits, ids[:, 1:])[0, len(prompt) - 1 :]
        torch.testing.assert_close(recomputed, torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


def test_a_batch_mixing_shared_and_unshared_prompts_prefills_each_distinct_prompt_once_unpadded(world_tokenizer, world_policy, monkeypatch):
    """One prompt repeated, two not: the three distinct prompts are encoded whole in one prefill (its
    rows padded only to the longest of them), every row's first token comes from those logits, and no
    later prefill pads the repeated prompt's rows to the unshared ones; greedy tokens are each
    prompt's alone."""
    prefills = []
    prefill = FusedDecoder.prefill
    monkeypatch.setattr(FusedDecoder, "prefill", lambda self, ids, *args: prefills.append(tuple(ids.shape)) or prefill(self, ids, *args))
    engine = HFEngine(world_policy, world_tokenizer, prefix_cache=False)
    engine.stop_token_ids = {-1}
    first, second, third = _prompts(world_tokenizer)
    prompts = [first, second, first, third, first]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    batched = engine.generate(prompts, greedy)
    assert prefills == [(3, max(len(first), len(second), len(third)))]
    single = {tuple(p): engine.generate([p], greedy)[0].token_ids for p in (first, second, third)}
    assert [g.token_ids for g in batched] == [single[tuple(p)] for p in prompts]


def test_budget_and_finish_reason(world_tokenizer, world_policy):
    engine = HFEngine(world_policy, world_tokenizer)
    gens = engine.generate(_prompts(world_tokenizer), SamplingParams(temperature=1.0, max_new_tokens=3))
    for gen in gens:
        assert len(gen.token_ids) <= 3
        ended = gen.token_ids[-1:] == [world_tokenizer.eos_token_id]
        assert gen.finish_reason == ("stop" if ended else "length")


def test_truncate_at_stop_rules():
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # 1 -> "a", 2 -> "b", ...
    out = truncate_at_stop([1, 2, 9, 3], [0.1, 0.2, 0.3, 0.4], {9}, [], decode, budget_exhausted=True)
    assert out.token_ids == [1, 2, 9] and out.logprobs == [0.1, 0.2, 0.3] and out.finish_reason == "stop"
    out = truncate_at_stop([1, 2, 3, 4], [0.0] * 4, {9}, ["bc"], decode, budget_exhausted=True)
    assert out.token_ids == [1, 2, 3] and out.finish_reason == "stop"
    out = truncate_at_stop([1, 2], [0.0] * 2, {9}, [], decode, budget_exhausted=True)
    assert out.finish_reason == "length"


def test_stop_strings(world_tokenizer, world_policy):
    engine = HFEngine(world_policy, world_tokenizer)
    torch.manual_seed(1)
    gens = engine.generate(_prompts(world_tokenizer) * 4, SamplingParams(temperature=1.5, max_new_tokens=16, stop=["e"]))
    for gen in gens:
        text = world_tokenizer.decode(gen.token_ids)
        if "e" in text:
            assert world_tokenizer.decode(gen.token_ids[:-1]).count("e") == 0


def _recomputed_logprobs(policy, prompt, gen, temperature):
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[:, :-1] / temperature
    return selective_log_softmax(logits, ids[:, 1:])[0, len(prompt) - 1 :]


def test_prefix_cache_reuses_previous_turns_and_matches_recomputation(world_tokenizer, world_policy):
    """Second turn of three conversations of different lengths: the cached KV (re-padded per row)
    gives the same behaviour log-probs as a fresh forward pass over the whole conversation."""
    torch.manual_seed(0)
    engine = HFEngine(world_policy, world_tokenizer)
    chat = ChatFormatter(world_tokenizer)
    first = _prompts(world_tokenizer)
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    turn1 = engine.generate(first, params)
    observations = ["You take the apple.", "Nothing happens here at all.", "ok"]
    second = [
        p + g.token_ids + chat.next_user_turn(o, g.token_ids[-1:] == [world_tokenizer.eos_token_id])
        for p, g, o in zip(first, turn1, observations)
    ]
    reused_before = engine.stats["reused_prompt_tokens"]
    turn2 = engine.generate(second, params)
    assert engine.stats["reused_prompt_tokens"] - reused_before == sum(len(p) + len(g.token_ids) - 1 for p, g in zip(first, turn1))
    for prompt, gen in zip(second, turn2):
        torch.testing.assert_close(_recomputed_logprobs(world_policy, prompt, gen, 0.8), torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


def test_prefix_cache_greedy_equals_uncached_engine(world_tokenizer, world_policy):
    cached, plain = HFEngine(world_policy, world_tokenizer), HFEngine(world_policy, world_tokenizer, prefix_cache=False)
    chat = ChatFormatter(world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    prompts = _prompts(world_tokenizer)
    for _ in range(3):
        a, b = cached.generate(prompts, params), plain.generate(prompts, params)
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        prompts = [p + g.token_ids + chat.next_user_turn("look", g.token_ids[-1:] == [world_tokenizer.eos_token_id]) for p, g in zip(prompts, a)]
    assert cached.cache_hit_rate() > 0.5 and plain.cache_hit_rate() == 0.0


def test_prefix_cache_is_dropped_when_weights_change(world_tokenizer, world_policy):
    engine = HFEngine(world_policy, world_tokenizer)
    stores, store = [], engine._store
    engine._store = lambda *args: stores.append(len(args[0])) or store(*args)
    prompts = _prompts(world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    gens = engine.generate(prompts, params)
    assert not engine.prefix_cache.entries and not stores  # cut into entries by the next call only
    with torch.no_grad():
        for p in world_policy.parameters():
            p.mul_(1.01)
    longer = [p + g.token_ids + [world_tokenizer.eos_token_id] for p, g in zip(prompts, gens)]
    reused_before = engine.stats["reused_prompt_tokens"]
    engine.generate(longer, params)
    assert engine.stats["reused_prompt_tokens"] == reused_before
    assert not stores  # the first call's sequences were never cut: the weights had changed
    engine.flush_prefix_cache()
    assert stores == [len(prompts)] and len(engine.prefix_cache.entries) == len(prompts)


def test_prefix_cache_evicts_least_recently_used():
    cache = PrefixKVCache(max_tokens=5)
    kv = [(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))]
    cache.put([1, 2], kv)
    cache.put([3, 4], kv)
    assert cache.longest_prefix([1, 2, 9])[0] == 2  # touches [1, 2]
    cache.put([5, 6], kv)  # 6 tokens > 5: evicts [3, 4], the least recently used
    assert cache.longest_prefix([3, 4, 9]) == (0, None)
    assert cache.longest_prefix([1, 2]) == (0, None)  # a prompt equal to the entry leaves nothing to prefill
    assert cache.longest_prefix([1, 2, 7])[0] == 2 and cache.tokens == 4


def test_prefix_cache_hashes_on_cpu_whatever_the_default_device():
    # Lightning builds the engine under trainer.init_module(), which sets the default device to the
    # GPU; "meta" stands in for it here.
    with torch.device("meta"):
        cache = PrefixKVCache(max_tokens=100)
    kv = [(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))]
    cache.put([1, 2, 3], kv)
    assert cache.longest_prefix([1, 2, 3, 4])[0] == 3


def test_long_tensor_equals_torch_tensor_on_cpu_whatever_the_default_device():
    tokens = [3, 0, 2**40, 859]
    with torch.device("meta"):
        made = [long_tensor(tokens), long_tensor(array("q", tokens)), long_tensor([])]
    assert all(t.device.type == "cpu" and t.dtype == torch.long for t in made)
    assert torch.equal(made[0], torch.tensor(tokens)) and torch.equal(made[1], torch.tensor(tokens))
    assert made[2].shape == (0,)


def test_batch_layout_and_cached_prefixes_written_into_the_growing_buffer(world_tokenizer):
    # Row 0 has 2 cached tokens and 1 to prefill, row 1 nothing cached and 3 to prefill: cached parts
    # are left-padded to 2 columns, suffixes to 3, so both rows end at column 5.
    pad = world_tokenizer.pad_token_id
    keys, values = torch.arange(4.0).view(1, 2, 2), -torch.arange(4.0).view(1, 2, 2)  # [KVH, 2 cached, D]
    ids, mask, past = batch_inputs([[5, 6, 7], [9, 10, 11]], [(2, [(keys, values)]), (0, None)], pad, torch.device("cpu"), new_tokens=3)
    assert ids.tolist() == [[5, 6, pad, pad, 7], [pad, pad, 9, 10, 11]]
    assert mask.tolist() == [[1, 1, 0, 0, 1], [0, 0, 1, 1, 1]]
    layer = past.layers[0]
    assert past.get_seq_length() == 2
    assert torch.equal(layer.keys[0], keys) and torch.equal(layer.values[0], values)
    assert not layer.keys[1].any() and not layer.values[1].any()  # nothing cached: zeros (finite, masked)
    buffer = layer.keys.data_ptr()
    appended = torch.ones(2, 1, 3, 2)
    out_keys, _ = past.update(appended, appended, 0)  # the suffix's prefill appends in place
    assert out_keys.shape == (2, 1, 5, 2) and out_keys.data_ptr() == buffer
    assert torch.equal(out_keys[:, :, 2:], appended) and torch.equal(out_keys[0, :, :2], keys)


def test_stored_sequences_do_not_follow_later_edits_of_the_callers_prompt_lists(world_tokenizer, world_policy):
    # Sequences are stored at the next call; a caller that extends its prompt lists in place meanwhile
    # must not change what the stored keys and values stand for.
    engine = HFEngine(world_policy, world_tokenizer)
    prompts = _prompts(world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = [p + g.token_ids[:-1] for p, g in zip(prompts, engine.generate(prompts, params))]
    for prompt in prompts:
        prompt.extend([5, 6, 7])
    engine.flush_prefix_cache()
    assert sorted(engine.prefix_cache.entries) == sorted(tuple(sequence) for sequence in expected)
