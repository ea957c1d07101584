"""One decoding step of a Llama-family model (llama, qwen2, qwen3) computed from the model's own modules,
with fewer, larger operations than its ``forward``.

At rollout sizes a decoding step is a few hundred small operations, and on a CPU their dispatch cost
more than their arithmetic: the model's forward for one token of 64 rows of a 3M-parameter Qwen2 spent
~2.5 ms per step in Python and per-op overhead against ~2.3 ms of matmuls. This step computes the same
function with the query/key/value projections as one matmul and the gate/up projections as one (their
weights concatenated once per weight version), rotary embeddings applied to queries and keys together,
and grouped-query attention without repeating keys; the norms are the family's RMSNorm computed by
``F.rms_norm`` (the module's arithmetic, to the bit, in one call); activations, the output projections
and the LM head are the model's own modules. It reads and appends to the engine's KV cache, so the prefix cache
is unchanged. ``FusedDecoder.prefill`` does the same for a prefill of several columns per row (the
engine uses it on the CPU), with ``padded_prefill_attention``. Results equal the forward's up to float
rounding (tests/engines/test_fused_decode.py: greedy tokens identical, log-probs within 1e-5 in fp32).

On a CPU in float32, for models of ``PACKED_MIN_HIDDEN`` hidden units and more, every projection and
the LM head run as oneDNN linears over weights reordered once into its blocked layout
(``Projection``): at decoding shapes (a few dozen rows against a weight of hundreds of thousands of
entries) oneDNN's kernel on a packed weight is 1.4-2.6x faster than ``F.linear``'s sgemm on SmolLM2's
shapes, the 49,152-wide LM head the most (benchmarks/real_model.py). Below that width its per-call cost
cancels the gain, and tiny policies keep ``F.linear``.

With ``matmul_dtype`` bfloat16 (the engine's choice when the trainer runs under bfloat16 autocast) the
projections and the LM head multiply bfloat16 copies of the weights by bfloat16 inputs and hand back
their outputs in the parameters' dtype, as autocast's linears do; the residual stream, norms, rotary
embeddings, attention, KV cache and sampler stay in the parameters' dtype. At decoding shapes the
matmuls read every weight once per step, so halving their bytes took SmolLM2's step's matmuls to
0.60-0.65x of their float32 time (32 and 64 rows; benchmarks/real_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

FAMILY = ("llama", "qwen2", "qwen3")
PACKED_MIN_HIDDEN = 256
"""Hidden width from which a CPU float32 decoding step runs packed oneDNN linears (``Projection``): at
width 128 (the tiny recipes' policies) they were 0.83-1.13x ``F.linear``'s speed, at 256 and more
1.5-2.6x."""
PACK_ROWS_HINT = 64
"""The row count oneDNN's weight reorder is told to expect (any count works; it picks the blocking)."""
SDPA_OR_EAGER = ("sdpa", "eager", "r3l_sdpa")
"""Attention implementations whose decoding the fused step computes: transformers' sdpa and eager, and the
trainer's ``r3l_sdpa`` (``training/attention.py``: sdpa outside a CPU autocast, where engines decode)."""
# Rotary types whose inverse frequencies do not change with the sequence length (``dynamic`` and
# ``longrope`` rescale them inside the forward).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def grouped_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of one new token per row: query [B, H, D], key / value [B, KVH, L, D] (H a multiple of
    KVH; the first L columns of a cache buffer are fine: read in place), ``attention_mask`` additive
    [B, 1, 1, L]; returns [B, H * D].

    The query heads that share a key/value head are one [G, D] x [D, L] product, so keys are never
    repeated per query head; SDPA's CPU kernel spent ~0.3 ms a call on this one-query shape, two
    batched matmuls take about half of that. They are ``bmm`` over [B KVH] views, the very kernel
    ``matmul`` of the 4-d tensors ends in (the same values to the bit) without its expand and reshape.
    """
    batch, heads, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    keys, values = key.reshape(batch * kv_heads, length, dim), value.reshape(batch * kv_heads, length, dim)
    scores = torch.bmm(query.reshape(batch * kv_heads, groups, dim), keys.transpose(1, 2)).mul_(scaling)
    weights = torch.softmax(scores.view(batch, kv_heads, groups, length).add_(attention_mask), dim=-1)
    return torch.bmm(weights.view(batch * kv_heads, groups, length), values).view(batch, heads * dim)


def padded_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attended: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of the last S columns of each row over its L columns, padding columns masked:
    query [B, H, S, D], key / value [B, KVH, L, D] (H a multiple of KVH), ``attended`` [B, L] (nonzero
    where a column holds a real token); query s sits at column L - S + s. Returns [B, S, H * D].

    A [B, 1, S, L] mask of padding and causality would have to be built and read by every call (on the
    CPU its construction, or SDPA's conversion of a boolean one, cost as much as the attention itself for
    a batch-64 agent-loop prefill). Padding depends only on the key, so it rides along as one more head
    dimension instead: queries get a 1 there, keys their bias (0, or a huge negative number on padding),
    and the product adds the bias to every score of that key. What is left is the causal mask, the same
    for every row: [1, 1, S, L], broadcast by SDPA. Values get a 0 there (SDPA's CPU kernels need equal
    query and value head sizes), dropped from the output.
    """
    batch, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    masked = torch.finfo(query.dtype).min / 2  # plus any score stays finite; times the scale it stays hugely negative
    key_bias = (attended[:, None, :, None] == 0).to(query.dtype).mul_(masked).expand(batch, kv_heads, length, 1)
    query = torch.cat([query, query.new_ones((batch, heads, width, 1))], dim=-1)
    key = torch.cat([key, key_bias], dim=-1)
    value = torch.cat([value, value.new_zeros((batch, kv_heads, length, 1))], dim=-1)
    causal = torch.full((width, length), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
    causal = causal.triu_(length - width + 1)[None, None]  # query s sees columns up to L - S + s
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=heads != kv_heads)
    return out[..., :dim].transpose(1, 2).reshape(batch, width, heads * dim)


def fused_decode_unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot decode with ``FusedDecoder`` (None when it can): a model type outside the
    family, sliding-window layers, a rotary type that changes with the length, projections that are not
    plain ``nn.Linear`` (LoRA adapters, quantized layers), norms that are not the family's RMSNorm or an
    attention kernel other than sdpa/eager."""
    config = model.config
    if config.model_type not in FAMILY:
        return f"model type {config.model_type!r} (fused decoding covers {', '.join(FAMILY)})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if config._attn_implementation not in SDPA_OR_EAGER:
        return f"attention implementation {config._attn_implementation!r}"
    decoder = getattr(model, "model", None)
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not the family's plain *ForCausalLM (a wrapper, e.g. for LoRA adapters)"
    if getattr(decoder.rotary_emb, "rope_type", None) not in STATIC_ROPE:
        return f"rotary type {getattr(decoder.rotary_emb, 'rope_type', None)!r}"
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(linear) is not nn.Linear for linear in linears):
            return "projections that are not plain nn.Linear (adapters or quantized layers)"
    if type(model.lm_head) is not nn.Linear:
        return "an LM head that is not a plain nn.Linear"
    norms = [decoder.norm]
    for layer in decoder.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)]
    if not all(type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") for norm in norms):
        return "norms other than the family's RMSNorm (weight x x / rms(x), read by family_rms_norm)"
    return None


def packs_linears(model: nn.Module, matmul_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether ``model``'s decoding step can run packed oneDNN linears (``Projection``) with matmuls in
    ``matmul_dtype`` (None: the weights' own): float32 weights on a CPU with oneDNN, hidden width at
    least ``PACKED_MIN_HIDDEN``, and for bfloat16 matmuls a CPU with oneDNN's bfloat16 kernels."""
    weight = model.lm_head.weight
    dtype = matmul_dtype or weight.dtype
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        and model.config.hidden_size >= PACKED_MIN_HIDDEN
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


@dataclass
class Projection:
    """A weight [out, in] and bias [out] (or None) as the decoding step multiplies by them: either the
    plain tensors (``F.linear`` / ``addmm``) or, with ``packed``, the weight reordered into oneDNN's
    blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, a copy made once per weight version)
    and applied by oneDNN's linear. Both compute x Wᵀ + b, equal up to float rounding. ``dtype``: the
    matmul's; inputs of another dtype are cast to it and the output back to theirs (autocast's
    rounding: the product of the rounded operands, rounded once more)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    packed: bool = False
    dtype: Optional[torch.dtype] = None  # None: the weight's

    def __post_init__(self) -> None:
        self.dtype = self.dtype or self.weight.dtype

    @classmethod
    def of(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], pack: bool, dtype: Optional[torch.dtype] = None) -> "Projection":
        """The projection of ``weight`` and ``bias`` with matmuls in ``dtype`` (None: the weight's; another
        dtype makes a cast copy, once per weight version)."""
        dtype = dtype or weight.dtype
        if dtype != weight.dtype:
            weight, bias = weight.detach().to(dtype), (bias.detach().to(dtype) if bias is not None else None)
        if not pack:
            return cls(weight, bias, dtype=dtype)
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT), bias, True, dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b for ``x`` in the matmul's dtype, in that dtype."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b: [..., in] -> [..., out], in ``x``'s dtype."""
        if x.dtype != self.dtype:
            return self._product(x.to(self.dtype)).to(x.dtype)
        return self._product(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x Wᵀ + b, [B, out]: one kernel (oneDNN's add post-op, or an addmm when plain and
        without bias) when ``residual`` is in the matmul's dtype; else the product in its own dtype,
        added in the residual's (type promotion widens it exactly: no separate cast)."""
        if residual.dtype != self.dtype:
            return residual + self._product(x.to(self.dtype))
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)


@dataclass
class FusedLayerWeights:
    """One layer's projections: qkv [(H + 2 KVH) D, hidden] and gate_up [2 I, hidden] concatenated,
    out (``o_proj``) and down (``down_proj``) as they are."""

    qkv: Projection
    gate_up: Projection
    out: Projection
    down: Projection


def _cat_or_none(tensors: list[Optional[torch.Tensor]], fill_like: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Biases concatenated; a missing one (some projections without bias) counts as zeros."""
    if all(t is None for t in tensors):
        return None
    return torch.cat([t if t is not None else w.new_zeros(w.shape[0]) for t, w in zip(tensors, fill_like)])


def family_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` [..., hidden] for the family's RMSNorm modules, to the bit: x / rms(x) in float32,
    cast back, times the weight. ``F.rms_norm`` without a weight runs the same pow, mean, add, rsqrt
    and mul as the module's forward, but from C++ rather than one Python dispatch each (nine norms a
    decoding step; ``fused_decode_unsupported`` checks the modules are the family's). In float32 the
    casts are no-ops and the module's last product, x / rms(x) times the weight, is the one
    ``F.rms_norm`` makes with the weight given: one call instead of four, to the bit."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight=norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def fold_rotation_sign(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., D] with its first half negated, for ``rotate``."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
    """The family's rotary embedding x cos + [-x2, x1] sin over the last dimension (x = [x1, x2]), with
    the sign taken from ``folded_sin`` (``fold_rotation_sign(sin)``): [x2, x1] is a roll, and
    x2 (-s) equals (-x2) s to the bit, so per layer one kernel (the negation) less is run."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * folded_sin


class FusedDecoder:
    """Decoding steps for ``model`` (see the module docstring); ``fused_decode_unsupported(model)`` must
    be None. ``refresh`` rebuilds the fused weights when a parameter changed or the matmul dtype asked
    for did, so steps after it see the live weights. ``pack``: run packed oneDNN linears where
    ``packs_linears(model, matmul_dtype)`` (checked at each refresh); off for ``step_static``, whose
    compiled graph takes plain weights."""

    def __init__(self, model: nn.Module, pack: bool = True) -> None:
        self.model = model
        self.pack = pack
        self.wide = model.config.hidden_size >= PACKED_MIN_HIDDEN
        self.packed = False
        self._lm_head: Optional[Projection] = None
        self.decoder = model.model
        attention = self.decoder.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.intermediate = self.decoder.layers[0].mlp.gate_proj.out_features
        self._weights: list[FusedLayerWeights] = []
        self._built_for: Optional[tuple] = None
        self.matmul_dtype: Optional[torch.dtype] = None  # of the last refresh

    def refresh(self, weights_state: tuple, matmul_dtype: Optional[torch.dtype] = None) -> None:
        """Concatenate the projections again if ``weights_state`` (the engine's token of the model's
        parameters: storages and in-place versions) or ``matmul_dtype`` (the projections' and LM head's
        matmul dtype; None: the parameters') differs from the one they were built under."""
        dtype = matmul_dtype or self.model.lm_head.weight.dtype
        if (weights_state, dtype) == self._built_for:
            return
        pack = self.packed = self.pack and packs_linears(self.model, dtype)
        self.matmul_dtype = dtype
        self._weights = []
        with torch.no_grad():
            for layer in self.decoder.layers:
                attention, mlp = layer.self_attn, layer.mlp
                qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
                gate_up = [mlp.gate_proj, mlp.up_proj]
                self._weights.append(FusedLayerWeights(
                    qkv=Projection.of(torch.cat([m.weight for m in qkv]), _cat_or_none([m.bias for m in qkv], [m.weight for m in qkv]), pack, dtype),
                    gate_up=Projection.of(torch.cat([m.weight for m in gate_up]), _cat_or_none([m.bias for m in gate_up], [m.weight for m in gate_up]), pack, dtype),
                    out=Projection.of(attention.o_proj.weight, attention.o_proj.bias, pack, dtype),
                    down=Projection.of(mlp.down_proj.weight, mlp.down_proj.bias, pack, dtype),
                ))
            self._lm_head = Projection.of(self.model.lm_head.weight, self.model.lm_head.bias, pack, dtype)
        self._built_for = (weights_state, dtype)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the sign-folded sin (``fold_rotation_sign``) [B, 1, D] at ``positions`` [B], as the
        model's rotary embedding computes cos and sin."""
        rotary = self.decoder.rotary_emb
        freqs = positions[:, None].float() * rotary.inv_freq[None, :].float()  # [B, D / 2]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos = (angles.cos() * rotary.attention_scaling).to(dtype)[:, None]
        return cos, fold_rotation_sign((angles.sin() * rotary.attention_scaling).to(dtype)[:, None])

    def rotated_queries_and_keys(self, attention: nn.Module, qkv: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
        """Queries and keys [N, H + KVH, D] rotated, from the fused projection's output ``qkv``
        [N, (H + 2 KVH) D] and ``rotary``'s cos and sine [N, 1, D]. They are adjacent in ``qkv``, so
        one rotation of a view covers both, with no copy; qwen3 first normalizes each head."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        query_key = qkv[:, : (heads + kv_heads) * dim].view(-1, heads + kv_heads, dim)
        if hasattr(attention, "q_norm"):
            query_key = torch.cat([family_rms_norm(attention.q_norm, query_key[:, :heads]),
                                   family_rms_norm(attention.k_norm, query_key[:, heads:])], dim=1)
        return rotate(query_key, cos, folded_sin)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, cache, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after ``token_ids`` [B] at ``positions`` [B], whose keys and
        values are appended to ``cache`` (a ``DynamicCache`` holding every earlier column);
        ``attention_mask`` [B, 1, 1, L] is additive over the L columns after the append. Uses the
        weights of the last ``refresh``."""
        return self._decode_layers(token_ids, positions, attention_mask, lambda index, key, value: cache.layers[index].update(key, value))

    def step_static(
        self, token_ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor,
        buffers: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``step`` over fixed-size key/value buffers, for ``torch.compile`` with static shapes: each
        layer's keys and values [B, KVH, C, D] in ``buffers`` get the new column written at ``column``
        ([1], long) and attention reads all C columns; ``attention_mask`` [B, 1, 1, C] is additive and
        must mask every column not written yet (their contents must be finite: a zero weight times NaN
        would still be NaN). Returns logits [B, V]; equal to ``step``'s up to float rounding."""

        def write(index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = buffers[index]
            return keys.index_copy_(2, column, key), values.index_copy_(2, column, value)

        return self._decode_layers(token_ids, positions, attention_mask, write)

    def _decode_layers(self, token_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, append) -> torch.Tensor:
        """The decoding step's layers; ``append(layer index, key [B, KVH, 1, D], value [B, KVH, 1, D])``
        stores the new column and returns the layer's keys and values [B, KVH, L, D] to attend over."""
        rows, heads, kv_heads, dim = token_ids.shape[0], self.heads, self.kv_heads, self.head_dim
        hidden = self.decoder.embed_tokens(token_ids)  # [B, hidden]
        cos, folded_sin = self.rotary(positions, hidden.dtype)
        for index, (layer, fused) in enumerate(zip(self.decoder.layers, self._weights)):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = fused.qkv(family_rms_norm(layer.input_layernorm, hidden))
            rotated = self.rotated_queries_and_keys(attention, qkv, cos, folded_sin)
            value = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, 1, dim)
            keys, values = append(index, rotated[:, heads:, None], value)
            out = grouped_decode_attention(rotated[:, :heads], keys, values, attention_mask, self.scaling)
            hidden = fused.out.add_to(hidden, out)
            gate, up = fused.gate_up(family_rms_norm(layer.post_attention_layernorm, hidden)).split(self.intermediate, dim=-1)
            hidden = fused.down.add_to(hidden, mlp.act_fn(gate) * up)
        return self._lm_head(family_rms_norm(self.decoder.norm, hidden))

    def prefill(self, token_ids: torch.Tensor, positions: torch.Tensor, cache, attended: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the token after the last of ``token_ids`` [B, S] (at ``positions`` [B, S]),
        whose keys and values are appended to ``cache`` (holding the L - S columns before them);
        ``attended`` [B, L] marks the real tokens among all L columns. Uses the weights of the last
        ``refresh``.

        Attention is ``padded_prefill_attention``, except in the last layer: its outputs at the other
        columns feed nothing (keys and values come from a layer's input), so only the last column
        attends, as a decoding step would, and only it goes through the last MLP."""
        rows, width = token_ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        hidden = self.decoder.embed_tokens(token_ids).reshape(rows * width, -1)  # [B S, hidden]
        cos, folded_sin = self.rotary(positions.reshape(-1), hidden.dtype)  # [B S, 1, D]
        last = len(self._weights) - 1
        for index, (layer, fused) in enumerate(zip(self.decoder.layers, self._weights)):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = fused.qkv(family_rms_norm(layer.input_layernorm, hidden))
            value = qkv[:, (heads + kv_heads) * dim :].view(rows, width, kv_heads, dim).transpose(1, 2)
            rotated = self.rotated_queries_and_keys(attention, qkv, cos, folded_sin).view(rows, width, heads + kv_heads, dim).transpose(1, 2)
            keys, values = cache.update(rotated[:, heads:], value, index)  # [B, KVH, L, D]; a cold cache gets its layers here
            if index < last:
                out = padded_prefill_attention(rotated[:, :heads], keys, values, attended, self.scaling)
                hidden = fused.out.add_to(hidden, out.reshape(rows * width, heads * dim))
            else:
                padding = (attended == 0).to(hidden.dtype).mul_(torch.finfo(hidden.dtype).min)[:, None, None]  # [B, 1, 1, L]
                out = grouped_decode_attention(rotated[:, :heads, -1], keys, values, padding, self.scaling)
                hidden = fused.out.add_to(hidden.view(rows, width, -1)[:, -1], out)
            gate, up = fused.gate_up(family_rms_norm(layer.post_attention_layernorm, hidden)).split(self.intermediate, dim=-1)
            hidden = fused.down.add_to(hidden, mlp.act_fn(gate) * up)
        return self._lm_head(family_rms_norm(self.decoder.norm, hidden))
