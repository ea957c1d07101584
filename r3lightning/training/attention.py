"""The trainer's attention: transformers' ``sdpa``, except under a bfloat16 autocast on the CPU.

``trainer.precision: bf16-mixed`` runs the policy's forward inside ``torch.autocast``, which casts
``scaled_dot_product_attention``'s inputs to bfloat16. On the CPU that is slower, not faster: at the
GRPO step's shapes (SmolLM2, 64 rows of 65 new columns over 102, 9 query heads sharing 3 key/value
heads) the CPU flash kernel's forward and backward took 101 ms a layer in bfloat16 against 67 in
float32 (``python -m benchmarks.training_attention``). And transformers repeats every key and value
head for its query heads before the kernel whenever a mask is given on the CPU, a copy forward and a
sum backward. ``training_sdpa`` therefore runs, only under a CPU autocast, the attention in float32
with the kernel's own grouped-query support (``enable_gqa``): 46 ms a layer there. Everywhere else
(float32 training, CUDA, the engines' forwards, which run outside autocast) it is transformers'
``sdpa`` itself, so float32 runs keep their numbers to the bit.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

TRAINING_ATTENTION = "r3l_sdpa"
"""The attention implementation name the trainer's policy runs under (``use_training_attention``)."""


def _autocast_on_cpu(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def training_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` [B, H, S, D] over ``key`` / ``value`` [B, KVH, L, D] with transformers'
    mask (None, boolean or additive [B, 1, S, L]); returns [B, S, H, D] and no weights, as ``sdpa``.

    Under a CPU autocast: float32 inputs and output, autocast off inside, grouped-query heads shared
    by the kernel. Otherwise, and for a paged cache or a position bias: ``sdpa_attention_forward``."""
    if not _autocast_on_cpu(query) or kwargs.get("cache") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if causal and key.shape[2] > query.shape[2]:  # an empty static cache's prefill: SDPA's causal mask is top-left aligned
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=causal, enable_gqa=query.shape[1] != key.shape[1],
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TRAINING_ATTENTION, training_sdpa)
AttentionMaskInterface.register(TRAINING_ATTENTION, sdpa_mask)


def use_training_attention(model: torch.nn.Module) -> None:
    """Run ``model``'s attention through ``training_sdpa`` when it runs transformers' ``sdpa`` (other
    implementations, eager or flash attention, are left as they are)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(TRAINING_ATTENTION)
