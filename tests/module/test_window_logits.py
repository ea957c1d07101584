"""The training forward computes logits only where a loss reads them, and encodes a prompt that rows
share (a GRPO group's) once: the same log-probs, losses and gradients as one full forward per row."""

import contextlib

import pytest
import torch
from harness import LastStep, module_and_data, quiet_trainer

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.forward import window_start


@pytest.fixture(scope="module")
def trained():
    module, dm = module_and_data(algorithm=AlgorithmConfig(policy_loss="ppo_clip"), group_size=4, tasks_per_step=3)
    last = LastStep()
    quiet_trainer(1, callbacks=[last]).fit(module, dm)
    experience = last.output["experience"]
    experience.advantages = torch.randn(experience.advantages.shape, generator=torch.Generator().manual_seed(0))
    experience.advantages *= experience.loss_mask
    return module, experience


def _full_logits(module, experience):
    return module.policy(input_ids=experience.input_ids, attention_mask=experience.attention_mask).logits[:, :-1]


def test_window_logits_equal_the_full_forward(trained):
    module, experience = trained
    start = window_start(experience)
    prompts = {tuple(row[: start].tolist()) for row in experience.input_ids}
    assert start > 0 and len(prompts) < len(experience)  # groups share their prompt: the shared path runs
    with torch.no_grad():
        full = _full_logits(module, experience)
        window = module.prefix_forward.window_logits(module.policy, experience.input_ids, experience.attention_mask, start)
        logp = module.prefix_forward.sequence_logprobs(module.policy, experience, start).logp
        full_logp = module.prefix_forward.sequence_logprobs(module.policy, experience).logp
        unshared = module.prefix_forward.window_logits(module.policy, experience.input_ids[:1], experience.attention_mask[:1], start)
    assert window.shape == (len(experience), experience.input_ids.shape[1] - 1 - start, full.shape[-1])
    torch.testing.assert_close(window, full[:, start:], atol=1e-5, rtol=0)
    torch.testing.assert_close(logp, full_logp[:, start:], atol=1e-6, rtol=0)
    torch.testing.assert_close(unshared, full[:1, start:], atol=1e-6, rtol=0)  # one row: logits sliced only


def _loss_and_gradients(module, experience):
    module.policy.zero_grad()
    mask = experience.loss_mask[:, 1:]
    totals = {"rl_tokens": float(mask.sum()), "rl_seqs": float((mask.sum(-1) > 0).sum()), "sft_tokens": 0.0}
    out = module.micro_batch_loss(experience, totals)
    out["loss"].backward()
    grads = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return {k: float(v.detach()) for k, v in out.items()}, grads


def test_losses_and_gradients_equal_the_full_forward(trained, monkeypatch):
    module, experience = trained
    windowed, grads = _loss_and_gradients(module, experience)
    monkeypatch.setattr("r3lightning.module.window_start", lambda batch: 0)
    full, full_grads = _loss_and_gradients(module, experience)
    assert windowed.keys() == full.keys()
    for name in full:
        assert windowed[name] == pytest.approx(full[name], rel=1e-5, abs=1e-6), name
    torch.testing.assert_close(grads, full_grads, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_falls_back_to_per_row_prefixes_and_counts_it(trained):
    module, experience = trained
    start = window_start(experience)
    with torch.no_grad():
        shared = module.prefix_forward.window_logits(module.policy, experience.input_ids, experience.attention_mask, start)
    before = module.prefix_forward.sharing_off
    module.policy.gradient_checkpointing_enable()
    try:
        with torch.no_grad():
            recomputed = module.prefix_forward.window_logits(module.policy, experience.input_ids, experience.attention_mask, start)
    finally:
        module.policy.gradient_checkpointing_disable()
    assert module.prefix_forward.sharing_off == before + 1
    torch.testing.assert_close(recomputed, shared, atol=1e-5, rtol=0)


def test_response_entropy_equals_the_full_forward_at_response_tokens(trained):
    from r3lightning import algos

    module, experience = trained
    with torch.no_grad():
        entropy = module.prefix_forward.response_entropy(module.policy, experience, module.optim_config.micro_batch_size, module.device)
        full = algos.entropy_from_logits(_full_logits(module, experience) / experience.temperature)
    response = experience.turn_index[:, 1:] >= 0
    assert response.any() and entropy.shape == full.shape
    torch.testing.assert_close(entropy[response], full[response], atol=1e-5, rtol=0)


@contextlib.contextmanager
def torch_threads(count):
    """Run the block at ``count`` torch threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _prefix_gradients(model, input_ids, attention_mask, start):
    """The policy's gradients of a sum over ``window_logits`` at 2 torch threads."""
    from r3lightning.training.forward import PrefixSharedForward

    with torch_threads(2):
        model.zero_grad()
        logits = PrefixSharedForward().window_logits(model, input_ids, attention_mask, start)
        logits.logsumexp(-1).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_gradients_through_a_shared_prefix_are_the_same_bits_at_every_call_at_two_threads():
    """The rows' gradients flow back into their shared prefix's keys and values. Summed by advanced
    indexing's backward (an accumulating ``index_put_``) they came out in a different order from call to
    call at 2 threads once the cache is large (here a 300-token prefix), so a 2-thread run was not
    repeatable: the quickstart's first RL update differed every time it was resumed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config).float()
    prompts = torch.randint(1, 64, (4, 300)).repeat_interleave(8, dim=0)[torch.randperm(32)]
    input_ids = torch.cat([prompts, torch.randint(1, 64, (32, 6))], dim=1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::3, -2:] = 0  # right padding on some rows
    first = _prefix_gradients(model, input_ids, attention_mask, 300)
    for _ in range(6):
        assert torch.equal(_prefix_gradients(model, input_ids, attention_mask, 300), first)


def test_the_prefix_gather_sums_rows_as_one_threads_indexing_did():
    """``index_select``'s backward adds the rows of a prefix in row order, which is what indexing's
    backward did at one thread: 1-thread runs keep their numbers to the bit."""
    torch.manual_seed(0)
    keys = torch.randn(5, 2, 300, 16)
    row_of = torch.randint(0, 5, (32,))
    upstream = torch.randn(32, 2, 300, 16)
    gradients = []
    with torch_threads(1):
        for gather in (lambda k: k[row_of], lambda k: k.index_select(0, row_of)):
            leaf = keys.clone().requires_grad_(True)
            gather(leaf).backward(upstream)
            gradients.append(leaf.grad)
    assert torch.equal(gradients[0], gradients[1])
