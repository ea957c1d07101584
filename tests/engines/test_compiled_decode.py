"""The compiled fused decoding step (``HFEngine(decode="fused_compiled")``, ``engine.hf_decode: fused_compiled``) equals
the eager fused step: greedy tokens identical and log-probs within 1e-5 (fp32) under inductor, through
padding, shared prompts, prefix-cache hits, buffer widening and weight updates (qwen2; the layer code
is shared with the eager step, which test_fused_decode.py holds to the forward for each architecture); new sizes share one
dynamic graph; unseen shapes beyond the graph limit decode eagerly and are counted. Most tests trace
with the ``eager`` backend (the same graph, run by Python, in seconds); one compiles with inductor.
Dynamo reuses code compiled for the same function and shapes in one process, so tests that count
graphs reset it first."""

import pytest
import torch
from fused_models import chat_prompts, run_two_calls

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.compiled_step import column_bucket, compiled_graphs
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.training.models import TinyModelSpec, build_tiny_model


def _assert_same(compiled, eager, atol: float) -> None:
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


def test_column_bucket_rounds_up_to_a_multiple_of_64():
    assert [column_bucket(n) for n in (1, 63, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 192]


# The architectures' branches (biases, q/k norms, rotary scalings) are the layer code ``step`` and
# ``step_static`` share, held to the forward in test_fused_decode.py; what is the static step's own
# (buffer writes, masked columns, the sampler in the graph) is checked on qwen2, greedy and sampled.
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_steps_equal_the_eager_fused_steps(world_tokenizer, temperature):
    """The static-buffer step (every column of the widened buffer read, unwritten ones masked) and the
    sampler inside the graph give the eager fused step's tokens and log-probs; the same seed draws the
    same uniforms, so sampled tokens are equal too. The prefix cache sees the same keys and values."""
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)  # the family_models qwen2
    params = SamplingParams(temperature=temperature, max_new_tokens=12)
    engine, compiled = run_two_calls(model, world_tokenizer, "fused_compiled", params, compile_backend="eager")
    reference, eager = run_two_calls(model, world_tokenizer, "fused", params)
    _assert_same(compiled, eager, atol=1e-6)
    assert engine.stats["reused_prompt_tokens"] == reference.stats["reused_prompt_tokens"] > 0
    engine.flush_prefix_cache()
    reference.flush_prefix_cache()
    stored = [key for key in engine.prefix_cache.entries]
    assert stored == [key for key in reference.prefix_cache.entries]
    for key in stored:
        for (k1, v1), (k2, v2) in zip(engine.prefix_cache.entries[key][1], reference.prefix_cache.entries[key][1]):
            torch.testing.assert_close(k1, k2, atol=1e-6, rtol=0)
            torch.testing.assert_close(v1, v2, atol=1e-6, rtol=0)
    assert engine._compiled_step.shapes  # the compiled step decoded (its graphs may come from earlier tests)
    assert engine.metrics()["perf/hf_fused_compile_skipped"] == 0


def test_inductor_compiled_steps_equal_the_eager_fused_steps(world_tokenizer):
    """Inductor's generated kernels round differently from eager ones: greedy tokens identical, log-probs
    within 1e-5. One call, so one graph (~4 s of compilation on two cores with an empty inductor cache)."""
    model = build_tiny_model(TinyModelSpec(num_layers=1), world_tokenizer, seed=0)  # fewer kernels to compile
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompts = chat_prompts(world_tokenizer)  # of several lengths, one shared by four rows
    torch._dynamo.reset()  # or dynamo would reuse the code an ``eager``-backend test compiled for these shapes
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled")
    _assert_same(compiled.generate(prompts, params), HFEngine(model, world_tokenizer).generate(prompts, params), atol=1e-5)
    stats = compiled.compile_stats()
    assert stats["fused_compile"] and stats["graphs"] == 1 and stats["shapes_seen"] == 1
    assert [key.split("x")[0] for key in stats["compile_s"]] == [str(len(prompts))] and min(stats["compile_s"].values()) > 0


def test_compiled_steps_follow_parameter_updates(world_tokenizer):
    """Weights are graph inputs: after an in-place update the same graph decodes with the new weights
    (no recompilation: the shape count stays)."""
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled", compile_backend="eager")
    eager = HFEngine(model, world_tokenizer)
    prompts = chat_prompts(world_tokenizer)
    before = compiled.generate(prompts, params)
    graphs = compiled._compiled_step.graphs
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    after = compiled.generate(prompts, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    _assert_same(after, eager.generate(prompts, params), atol=1e-6)
    assert compiled._compiled_step.graphs == graphs


def test_new_sizes_share_one_dynamic_graph(world_tokenizer):
    """A call of another batch size and width compiles a graph with both sizes symbolic (dynamo's
    automatic dynamic shapes make the sizes that changed symbolic); later sizes and widths reuse it."""
    torch._dynamo.reset()  # graphs earlier tests compiled for the same code would be reused
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled", compile_backend="eager", prefix_cache=False)
    eager = HFEngine(model, world_tokenizer, prefix_cache=False)
    prompts = chat_prompts(world_tokenizer)
    long_prompts = [p + p for p in prompts[:4]]  # a wider buffer
    for batch in (prompts, long_prompts, prompts[:3], prompts[:5]):
        _assert_same(compiled.generate(batch, params), eager.generate(batch, params), atol=1e-6)
    step = compiled._compiled_step
    assert len(step.shapes) == 4 and step.graphs == 2 and len(step.compile_s) == 2


def test_a_group_batch_compiles_one_graph_and_counts_every_compilation(world_tokenizer):
    """When every row's prompt is shared (a GRPO batch), the first decoding step reads a column of the
    prompts' positions; a strided column would make dynamo compile a second graph at the next step (a
    stride guard), doubling the compile time. One graph, and the engine's count agrees with dynamo's."""
    torch._dynamo.reset()
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled", compile_backend="eager")
    compiled.stop_token_ids = {-1}  # every step decodes
    prompts = [prompt for prompt in chat_prompts(world_tokenizer, shared=False)[:2] for _ in range(4)]
    before = compiled_graphs()
    compiled.generate(prompts, params)
    assert compiled_graphs() - before == compiled._compiled_step.graphs == 1
    assert compiled.compile_stats()["graphs"] == 1


def test_a_new_temperature_compiles_its_own_graph(world_tokenizer):
    """Temperature and top_p are constants in the graph: greedy and sampled calls on one engine each get
    their graph (dynamo's guards on them) and the eager step's tokens."""
    torch._dynamo.reset()
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled", compile_backend="eager")
    eager = HFEngine(model, world_tokenizer)
    prompts = chat_prompts(world_tokenizer)
    for temperature in (0.0, 1.0, 0.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=6)
        torch.manual_seed(0)
        got = compiled.generate(prompts, params)
        torch.manual_seed(0)
        _assert_same(got, eager.generate(prompts, params), atol=1e-6)
    assert compiled._compiled_step.graphs == 2


def test_unseen_shapes_beyond_the_graph_limit_decode_eagerly_and_are_counted(world_tokenizer):
    torch._dynamo.reset()
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    compiled = HFEngine(model, world_tokenizer, decode="fused_compiled", compile_backend="eager", prefix_cache=False)
    eager = HFEngine(model, world_tokenizer, prefix_cache=False)
    prompts = chat_prompts(world_tokenizer)
    compiled.generate(prompts, params)
    compiled._compiled_step.max_graphs = 1  # the one graph compiled so far is the limit
    _assert_same(compiled.generate(prompts[:3], params), eager.generate(prompts[:3], params), atol=1e-6)
    assert compiled.stats["fused_compile_skipped"] == 1
    assert compiled.metrics()["perf/hf_fused_compile_skipped"] == 1.0
    compiled.generate(prompts, params)  # the shape it has a graph for still runs compiled
    assert compiled.stats["fused_compile_skipped"] == 1

