"""The trainer's attention (``training/attention.py``): transformers' sdpa to the bit outside a CPU
autocast; float32 attention with shared key/value heads inside one."""

import copy

import pytest
import torch
from torch.nn import functional as F

from r3lightning.engines.hf.fused_step import fused_decode_unsupported
from r3lightning.training.attention import TRAINING_ATTENTION, training_sdpa, use_training_attention
from r3lightning.training.models import TinyModelSpec, build_tiny_model


def _policy_pair(tokenizer):
    plain = build_tiny_model(TinyModelSpec(num_attention_heads=4, num_key_value_heads=2), tokenizer, seed=0)
    trained = copy.deepcopy(plain)
    use_training_attention(trained)
    return plain, trained


def _rows(tokenizer):
    torch.manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a right-padded row: transformers hands the kernel a mask
    return ids, mask


def test_only_sdpa_policies_switch_and_the_fused_decoder_still_covers_them(world_tokenizer):
    plain, trained = _policy_pair(world_tokenizer)
    assert plain.config._attn_implementation == "sdpa" and trained.config._attn_implementation == TRAINING_ATTENTION
    assert fused_decode_unsupported(trained) is None
    eager = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    eager.set_attn_implementation("eager")
    use_training_attention(eager)
    assert eager.config._attn_implementation == "eager"


def test_outside_autocast_the_forward_and_gradients_are_sdpas_to_the_bit(world_tokenizer):
    plain, trained = _policy_pair(world_tokenizer)
    ids, mask = _rows(world_tokenizer)
    results = []
    for model in (plain, trained):
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("mask_kind", ["none", "boolean", "additive"])
def test_under_cpu_autocast_attention_runs_in_float32_with_shared_key_value_heads(mask_kind):
    """Inside a bfloat16 autocast the result is float32 attention of the float32 inputs, heads repeated
    by hand for the reference: [B, S, H, D], the same as sdpa's layout."""
    torch.manual_seed(1)
    batch, heads, kv_heads, width, length, dim = 2, 6, 2, 5, 9, 16
    query = torch.randn(batch, heads, width, dim).bfloat16()
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim).bfloat16()
    allowed = torch.ones(batch, 1, width, length, dtype=torch.bool).tril_(length - width)
    allowed[0, ..., :2] = False
    mask = {"none": None, "boolean": allowed, "additive": torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    module = torch.nn.Module()
    module.is_causal = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = training_sdpa(module, query, key, value, mask, scaling=0.25)
    repeat = lambda x: x.float().repeat_interleave(heads // kv_heads, dim=1)
    causal = mask is None and width > 1
    expected = F.scaled_dot_product_attention(query.float(), repeat(key[:, :, :width] if causal else key), repeat(value[:, :, :width] if causal else value),
                                              attn_mask=mask, scale=0.25, is_causal=causal).transpose(1, 2)
    assert weights is None and out.dtype == torch.float32 and out.shape == (batch, width, heads, dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_a_bfloat16_autocast_forward_is_nearer_float32_with_the_training_attention(world_tokenizer):
    plain, trained = _policy_pair(world_tokenizer)
    ids, mask = _rows(world_tokenizer)
    with torch.no_grad():
        exact = plain(input_ids=ids, attention_mask=mask).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gaps = [(model(input_ids=ids, attention_mask=mask).logits.float() - exact)[mask.bool()].abs().mean() for model in (plain, trained)]
    assert gaps[1] < gaps[0]
