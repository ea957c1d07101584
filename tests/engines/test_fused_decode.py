"""The hf engine's fused decoding step equals the model's own forward: greedy tokens identical, behaviour
log-probs within 1e-5 (fp32), through padding, shared prompts, prefix-cache hits and weight updates; models
it does not cover decode with the forward and are counted."""

import copy

import pytest
import torch
from torch import nn
from fused_models import chat_prompts, family_models, run_two_calls, small_model
from transformers import MistralConfig, MistralForCausalLM

from r3lightning.training.models import TinyModelSpec, build_tiny_model
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.fused_step import (
    PACKED_MIN_HIDDEN,
    FusedDecoder,
    Projection,
    family_rms_norm,
    fold_rotation_sign,
    fused_decode_unsupported,
    grouped_decode_attention,
    packs_linears,
    padded_prefill_attention,
    rotate,
)
from r3lightning.engines.hf.engine import HFEngine, decoding_matmul_dtype


def test_grouped_decode_attention_is_attention_with_each_key_head_shared_by_its_query_group():
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    mask = torch.zeros(3, 1, 1, 5)
    mask[1, ..., :2] = torch.finfo(torch.float32).min  # row 1 does not see its first two columns
    out = grouped_decode_attention(query, key, value, mask, scaling=0.5)
    assert out.shape == (3, 32)
    for row in range(3):
        for head in range(4):
            kv = head // 2  # query heads 0, 1 read key/value head 0; heads 2, 3 read head 1
            weights = torch.softmax(key[row, kv] @ query[row, head] * 0.5 + mask[row, 0, 0], dim=-1)
            torch.testing.assert_close(out[row, head * 8 : (head + 1) * 8], weights @ value[row, kv])
    assert torch.allclose(out[1], grouped_decode_attention(query[1:2], key[1:2, :, 2:], value[1:2, :, 2:], mask[1:2, ..., 2:], 0.5)[0])


# The decoding step's rewritten pieces against the formulations they replaced, to the bit: a logged number
# of a run that decodes with them must not move.
@pytest.mark.parametrize("shape", [(64, 2, 4, 32, 50, 96), (3, 1, 7, 80, 17, 64)])  # B, KVH, G, D, L, buffer columns
def test_grouped_decode_attention_on_a_cache_buffer_equals_the_4d_matmuls_to_the_bit(shape):
    batch, kv_heads, groups, dim, length, columns = shape
    torch.manual_seed(0)
    keys, values = torch.randn(batch, kv_heads, columns, dim), torch.randn(batch, kv_heads, columns, dim)
    key, value = keys[:, :, :length], values[:, :, :length]  # the cache's view of its buffer
    query, mask = torch.randn(batch, kv_heads * groups, dim), torch.zeros(batch, 1, 1, length)
    mask[0, ..., :3] = torch.finfo(torch.float32).min
    grouped = query.reshape(batch, kv_heads, groups, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(0.17).add_(mask)
    expected = torch.matmul(torch.softmax(scores, dim=-1), value).reshape(batch, kv_heads * groups * dim)
    assert torch.equal(grouped_decode_attention(query, key, value, mask, 0.17), expected)


def test_rotation_with_the_sign_folded_into_the_sine_equals_rotate_half_to_the_bit():
    torch.manual_seed(0)
    x, cos, sin = torch.randn(64, 10, 32), torch.randn(64, 1, 32), torch.randn(64, 1, 32)
    rotated_half = torch.cat([-x[..., 16:], x[..., :16]], dim=-1)
    assert torch.equal(rotate(x, cos, fold_rotation_sign(sin)), x * cos + rotated_half * sin)
    assert rotate(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4), fold_rotation_sign(torch.ones(4))).tolist() == [-3.0, -4.0, 1.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", ["qwen2", "llama", "qwen3"])
def test_family_rms_norm_is_the_models_norm_to_the_bit(world_tokenizer, architecture, dtype):
    model = family_models(world_tokenizer)[architecture].to(dtype)
    torch.manual_seed(0)
    norms = [model.model.norm, model.model.layers[0].input_layernorm]
    norms += [model.model.layers[0].self_attn.q_norm] if architecture == "qwen3" else []
    for norm in norms:
        with torch.no_grad():
            norm.weight.copy_(torch.randn_like(norm.weight))
        for rows in (1, 7, 64):
            x = (torch.randn(rows, 3, norm.weight.shape[0]) * 4).to(dtype)
            assert torch.equal(family_rms_norm(norm, x), norm(x))


@pytest.mark.parametrize("hidden", [32, 64, 896, 3584])
def test_float32_family_rms_norm_in_one_call_is_the_models_norm_to_the_bit_on_views_too(hidden):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(hidden)
    norm = Qwen2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    wide = torch.randn(64, 3 * hidden) * 4
    for x in (wide[:, :hidden], wide[:1, hidden : 2 * hidden], wide.view(64, 3, hidden)[:, 1:]):  # strided views
        assert torch.equal(family_rms_norm(norm, x), norm(x))


@pytest.mark.parametrize("architecture", ["qwen2", "llama", "qwen3"])
def test_queries_and_keys_rotated_in_place_of_the_projection_equal_rotating_their_copy_to_the_bit(world_tokenizer, architecture):
    model = family_models(world_tokenizer)[architecture]
    decoder = FusedDecoder(model)
    attention, (heads, kv_heads, dim) = model.model.layers[0].self_attn, (decoder.heads, decoder.kv_heads, decoder.head_dim)
    torch.manual_seed(0)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim)
    cos, sin = decoder.rotary(torch.arange(5), torch.float32)
    query, key = qkv[:, : heads * dim].view(5, heads, dim), qkv[:, heads * dim : (heads + kv_heads) * dim].view(5, kv_heads, dim)
    if architecture == "qwen3":
        query, key = attention.q_norm(query), attention.k_norm(key)
    copied = rotate(torch.cat([query, key], dim=1), cos, sin)
    assert torch.equal(decoder.rotated_queries_and_keys(attention, qkv, cos, sin), copied)


def test_padded_prefill_attention_is_causal_attention_over_each_rows_real_columns():
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 3, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    attended = torch.ones(3, 6, dtype=torch.long)
    attended[1, :2] = 0  # row 1: two columns of left padding
    attended[2, :4] = 0  # row 2: its first query (column 3) sees only padding
    attended[2, 2] = 1
    out = padded_prefill_attention(query, key, value, attended, scaling=0.5)
    assert out.shape == (3, 3, 32) and torch.isfinite(out).all()
    for row in range(3):
        for s in range(3):
            column = 3 + s  # the last 3 of 6 columns are the queries
            for head in range(4):
                kv = head // 2
                seen = [j for j in range(column + 1) if attended[row, j]]
                if not seen:
                    continue  # a padding query: any finite output will do
                weights = torch.softmax(key[row, kv, seen] @ query[row, head, s] * 0.5, dim=-1)
                torch.testing.assert_close(out[row, s, head * 8 : (head + 1) * 8], weights @ value[row, kv, seen])


@pytest.mark.parametrize("layers", [1, 2])
def test_prefill_from_an_empty_cache_equals_the_forward(world_tokenizer, layers):
    """Rows of different lengths prefilled from nothing (left padding only). In a one-layer model the
    only layer is the last, so the prefill attends from its last column alone."""
    model = build_tiny_model(TinyModelSpec(num_layers=layers), world_tokenizer, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    _, fused = run_two_calls(model, world_tokenizer, "fused", params, shared=False)
    _, forward = run_two_calls(model, world_tokenizer, "forward", params, shared=False)
    assert [g.token_ids for g in fused] == [g.token_ids for g in forward]
    for a, b in zip(fused, forward):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_stays_finite_and_near_the_forward(world_tokenizer, dtype):
    """In bfloat16 and float16 the padding bias (a dtype-sized huge negative number) masks padding as
    in float32: log-probs finite and within the dtype's rounding of the forward's."""
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0).to(dtype)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    _, fused = run_two_calls(model, world_tokenizer, "fused", params, shared=False)
    _, forward = run_two_calls(model, world_tokenizer, "forward", params, shared=False)
    for a, b in zip(fused, forward):
        assert torch.isfinite(torch.tensor(a.logprobs)).all()
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.05, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen2_eager_attention", "llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_decoding_equals_the_forward(world_tokenizer, architecture, temperature):
    model = family_models(world_tokenizer)[architecture]
    assert fused_decode_unsupported(model) is None
    params = SamplingParams(temperature=temperature, max_new_tokens=12)
    engine, fused = run_two_calls(model, world_tokenizer, "fused", params)
    _, forward = run_two_calls(model, world_tokenizer, "forward", params)
    assert engine.metrics()["perf/hf_fused_decode_off"] == 0 and engine._fused is not None
    # Sampling draws one uniform per row: the same draws pick the same tokens unless a draw falls within
    # float rounding of a boundary, which these runs never hit.
    assert [g.token_ids for g in fused] == [g.token_ids for g in forward]
    for a, b in zip(fused, forward):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_fused_weights_follow_parameter_updates(world_tokenizer):
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    fused_engine = HFEngine(model, world_tokenizer, decode="fused")
    forward_engine = HFEngine(model, world_tokenizer, decode="forward")
    prompts = chat_prompts(world_tokenizer)
    before = fused_engine.generate(prompts, params)
    with torch.no_grad():  # an optimizer step's in-place update
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    after = fused_engine.generate(prompts, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    expected = forward_engine.generate(prompts, params)
    assert [g.token_ids for g in after] == [g.token_ids for g in expected]
    for a, b in zip(after, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_models_outside_the_family_decode_with_the_forward_and_are_counted(world_tokenizer):
    mistral = small_model(MistralConfig, MistralForCausalLM, world_tokenizer, sliding_window=None)
    assert "mistral" in fused_decode_unsupported(mistral)
    engine = HFEngine(mistral, world_tokenizer, decode="fused")
    out = engine.generate(chat_prompts(world_tokenizer), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert all(g.token_ids for g in out)
    assert engine.metrics()["perf/hf_fused_decode_off"] == 1 and engine._fused is None


def test_lora_policies_decode_with_the_forward(world_tokenizer):
    from r3lightning.training.models import ModelConfig, apply_lora

    model = apply_lora(build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0), ModelConfig(lora_rank=4))
    assert "wrapper" in fused_decode_unsupported(model)
    engine = HFEngine(model, world_tokenizer, decode="fused")
    engine.generate(chat_prompts(world_tokenizer), SamplingParams(temperature=1.0, max_new_tokens=4))
    assert engine.metrics()["perf/hf_fused_decode_off"] == 1


def test_adapted_or_quantized_projections_are_not_fused(world_tokenizer):
    class AdaptedLinear(nn.Linear):  # stands in for a LoRA or quantized layer: weight alone is not the map
        pass

    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    projection = model.model.layers[0].self_attn.q_proj
    adapted = AdaptedLinear(projection.in_features, projection.out_features, bias=True)
    model.model.layers[0].self_attn.q_proj = adapted
    assert "nn.Linear" in fused_decode_unsupported(model)


def test_norms_other_than_the_familys_rms_norm_are_not_fused(world_tokenizer):
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    model.model.layers[0].post_attention_layernorm = nn.LayerNorm(model.config.hidden_size)
    assert "RMSNorm" in fused_decode_unsupported(model)


def test_other_attention_kernels_keep_their_own_decoding(world_tokenizer):
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in fused_decode_unsupported(model)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _wide_model(tokenizer):
    """A model wide enough for packed oneDNN linears (``PACKED_MIN_HIDDEN``)."""
    return build_tiny_model(TinyModelSpec(hidden_size=PACKED_MIN_HIDDEN, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512), tokenizer, seed=0)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 130])
def test_a_packed_projection_is_the_linear_map_and_its_residual_sum(bias, rows):
    torch.manual_seed(rows)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    plain, packed = Projection.of(weight, b, pack=False), Projection.of(weight, b, pack=True)
    assert packed.packed and not plain.packed and plain.weight is weight  # plain: the tensor itself, no copy
    x, residual = torch.randn(rows, 40), torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, weight, b)
    torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(plain(x), expected)
    before = residual.clone()
    torch.testing.assert_close(packed.add_to(residual, x), residual + expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.add_to(residual, x), residual + expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(residual, before)  # the residual stream is read, not written
    torch.testing.assert_close(packed(x.view(1, rows, 40))[0], expected, atol=1e-5, rtol=1e-5)  # [..., in] inputs


@needs_onednn
def test_wide_float32_cpu_models_decode_with_packed_projections_and_equal_the_forward(world_tokenizer):
    """From PACKED_MIN_HIDDEN hidden units up (real models), the CPU float32 step runs oneDNN linears over
    packed weights: greedy tokens identical to the forward's, log-probs within 1e-5, through prefill,
    shared prompts, prefix-cache hits and a weight update. Narrower models keep F.linear."""
    wide = _wide_model(world_tokenizer)
    narrow = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    assert packs_linears(wide) and not packs_linears(narrow) and not packs_linears(copy.deepcopy(wide).double())
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine, fused = run_two_calls(wide, world_tokenizer, "fused", params)
    _, forward = run_two_calls(wide, world_tokenizer, "forward", params)
    assert engine._fused.packed and engine.metrics()["perf/hf_packed_linears"] == 1
    assert [g.token_ids for g in fused] == [g.token_ids for g in forward]
    for a, b in zip(fused, forward):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    with torch.no_grad():  # an optimizer step: the packed copies are rebuilt from the new weights
        for parameter in wide.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    prompts = chat_prompts(world_tokenizer)
    after = engine.generate(prompts, params)
    expected = HFEngine(wide, world_tokenizer, decode="forward").generate(prompts, params)
    assert [g.token_ids for g in after] == [g.token_ids for g in expected]


@needs_onednn
@pytest.mark.parametrize("decode", ["fused", "forward"])
def test_generation_under_bfloat16_autocast_with_parameters_matmuls_decodes_in_the_parameters_dtype(world_tokenizer, decode):
    """``engine.hf_matmul_dtype: parameters``: the engine decodes in its parameters' dtype inside the
    trainer's autocast as anywhere (packed oneDNN linears fed float32 inputs): the very tokens and
    log-probs it gives outside autocast. The forward does so whatever the matmul dtype."""
    wide = _wide_model(world_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = chat_prompts(world_tokenizer)
    torch.manual_seed(3)
    plain = HFEngine(wide, world_tokenizer, decode=decode).generate(prompts, params)
    for matmul_dtype in ("parameters", "auto") if decode == "forward" else ("parameters",):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = HFEngine(wide, world_tokenizer, decode=decode, matmul_dtype=matmul_dtype).generate(prompts, params)
        assert [g.token_ids for g in autocast] == [g.token_ids for g in plain]
        assert [g.logprobs for g in autocast] == [g.logprobs for g in plain]


def test_the_matmul_dtype_follows_a_bfloat16_autocast_only_when_auto():
    assert decoding_matmul_dtype("auto", "cpu") is None
    assert decoding_matmul_dtype("bfloat16", "cpu") is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decoding_matmul_dtype("auto", "cpu") is torch.bfloat16
        assert decoding_matmul_dtype("parameters", "cpu") is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert decoding_matmul_dtype("auto", "cpu") is None
    with pytest.raises(ValueError, match="matmul_dtype must be one of"):
        HFEngine(nn.Linear(1, 1), None, matmul_dtype="half")


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_a_bfloat16_projection_rounds_as_an_autocast_linear(pack, bias):
    """Inputs and weights rounded to bfloat16, their product rounded to bfloat16 and handed back in the
    input's dtype: what ``torch.autocast``'s linear gives (plain: to the bit; oneDNN's packed kernel
    within a bfloat16 rounding step)."""
    if pack and not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("no oneDNN bfloat16 kernels on this CPU")
    torch.manual_seed(5)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    x, residual = torch.randn(7, 40), torch.randn(7, 96)
    projection = Projection.of(weight, b, pack=pack, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.linear(x, weight, b)
    assert projection(x).dtype == torch.float32 and expected.dtype == torch.bfloat16
    tolerance = dict(atol=0.0, rtol=0.0) if not pack else dict(atol=2e-2, rtol=8e-3)
    torch.testing.assert_close(projection(x), expected.float(), **tolerance)
    torch.testing.assert_close(projection.add_to(residual, x), residual + expected.float(), **tolerance)
    assert projection.dtype == torch.bfloat16 and weight.dtype == torch.float32  # a copy, not the weight
    assert Projection(weight, b).dtype == torch.float32  # built directly: the weight's dtype


def _autocast_scores(model, prompts, generations) -> list[torch.Tensor]:
    """The trainer's log-probs of each completion under bfloat16 autocast (what ``bf16-mixed`` scores)."""
    scores = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for prompt, generation in zip(prompts, generations):
            ids = torch.tensor([prompt + generation.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, len(prompt) - 1 : -1], dim=-1)
            scores.append(logp.gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0])
    return scores


@needs_onednn
def test_under_bfloat16_autocast_fused_decoding_multiplies_in_bfloat16_near_the_trainers_scores(world_tokenizer):
    """``hf_matmul_dtype: auto`` inside the trainer's bfloat16 autocast: the fused step's matmuls run in
    bfloat16 (logged), and its behaviour log-probs lie nearer the trainer's autocast log-probs of the
    same tokens than float32 decoding's do; outside autocast nothing changes."""
    wide = _wide_model(world_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts = chat_prompts(world_tokenizer)
    gaps = {}
    for matmul_dtype in ("parameters", "auto"):
        engine = HFEngine(wide, world_tokenizer, decode="fused", matmul_dtype=matmul_dtype)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            generations = engine.generate(prompts, params)
        assert engine.metrics()["perf/hf_matmul_bfloat16"] == float(matmul_dtype == "auto")
        scores = _autocast_scores(wide, prompts, generations)
        gaps[matmul_dtype] = torch.cat([torch.tensor(g.logprobs) - s for g, s in zip(generations, scores)]).abs()
    assert gaps["auto"].mean() < gaps["parameters"].mean()
    assert gaps["auto"].max() < 0.05
    engine.generate(prompts, params)  # outside autocast: the parameters' dtype again
    assert engine.metrics()["perf/hf_matmul_bfloat16"] == 0.0


@needs_onednn
def test_a_prefix_cached_under_bfloat16_matmuls_is_not_reused_by_a_float32_call(world_tokenizer):
    wide = _wide_model(world_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompts = chat_prompts(world_tokenizer, shared=False)
    engine = HFEngine(wide, world_tokenizer, decode="fused")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = engine.generate(prompts, params)
    extended = [p + g.token_ids + p[-3:] for p, g in zip(prompts, first)]
    engine.generate(extended, params)  # float32 matmuls: the bfloat16 entries are dropped, not read
    assert engine.stats["reused_prompt_tokens"] == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = engine.generate(prompts, params)
        engine.generate([p + g.token_ids + p[-3:] for p, g in zip(prompts, again)], params)  # same dtype and weights: reused
    assert engine.stats["reused_prompt_tokens"] > 0


@pytest.mark.parametrize("width", ["narrow", "packed"])
def test_finished_rows_leave_the_batch_with_the_same_completions_and_prefix_cache(world_tokenizer, width):
    """Rows that finished are dropped from the decoding batch (``drop_finished_rows``): the same tokens
    and log-probs (within 1e-5) as decoding every row to the end, and the cache put back whole, so a
    second call that extends every row through the prefix cache gives the same again."""
    spec = TinyModelSpec() if width == "narrow" else TinyModelSpec(
        hidden_size=PACKED_MIN_HIDDEN, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    model = build_tiny_model(spec, world_tokenizer, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts = chat_prompts(world_tokenizer) + chat_prompts(world_tokenizer, shared=False)
    runs = {}
    for drop in (True, False):
        engine = HFEngine(model, world_tokenizer, decode="fused", drop_finished_rows=drop)
        engine.stop_token_ids = set(range(200))  # about a quarter of the vocabulary: rows end at different steps
        torch.manual_seed(0)
        first = engine.generate(prompts, params)
        second = engine.generate([p + g.token_ids + p[-3:] for p, g in zip(prompts, first)], params)
        runs[drop] = (first + second, engine.metrics(), engine.cache_hit_rate())
    (dropped, metrics, hits), (kept, kept_metrics, kept_hits) = runs[True], runs[False]
    assert len({len(g.token_ids) for g in kept[: len(prompts)]}) > 2
    assert [g.token_ids for g in dropped] == [g.token_ids for g in kept]
    for a, b in zip(dropped, kept):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert hits == kept_hits > 0.3
    assert 0 < metrics["perf/hf_decoded_row_share"] < 1 and kept_metrics["perf/hf_decoded_row_share"] == 1.0
