"""transformers' own compiled decoding for the ``hf`` engine (``hf_decode: generate_compiled``): ``generate``
with a ``StaticCache`` and ``torch.compile`` of its decoding step (the prefill stays eager), shapes
bucketed so that a run compiles a handful of times."""

from __future__ import annotations

import time
from typing import Optional

import torch
from transformers import DynamicCache, StaticCache
from transformers.generation.configuration_utils import CompileConfig

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.kv_cache import LayerKV


class CompiledGenerate:
    """``generate`` over bucketed static caches.

    The batch is padded to a power of two (at most ``max_batch_size``) with copies of its last prompt,
    whose completions the caller drops, and the cache length (prompt + new tokens) is rounded up to a
    power of two (at least 64). One ``StaticCache`` per (batch, length) bucket is kept and reset before
    each use (CUDA graphs need fixed addresses); a batch's cached prefixes are copied into its first
    columns. ``first_call_s`` holds the seconds of each bucket's first call (compilation included).

    Args:
        model: the policy (a transformers causal LM).
        tokenizer: its tokenizer (pad token set).
        max_batch_size: the largest batch bucket.
        mode: ``torch.compile`` mode; None: ``reduce-overhead`` (CUDA graphs) on CUDA, ``default`` elsewhere.
        backend: ``torch.compile`` backend (``inductor``; tests use ``eager``).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch_size: int, mode: Optional[str], backend: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.chosen_mode = mode
        self.backend = backend
        self.static_caches: dict[tuple[int, int], StaticCache] = {}
        self.first_call_s: dict[tuple[int, int], float] = {}

    def batch_bucket(self, n: int) -> int:
        return min(1 << max(n - 1, 0).bit_length(), max(self.max_batch_size, n))

    @staticmethod
    def length_bucket(n: int) -> int:
        return max(64, 1 << max(n - 1, 0).bit_length())

    def mode(self) -> str:
        if self.chosen_mode:
            return self.chosen_mode
        return "reduce-overhead" if next(self.model.parameters()).device.type == "cuda" else "default"

    def pad(
        self, prompts: list[list[int]], cached: list[tuple[int, Optional[LayerKV]]]
    ) -> tuple[list[list[int]], list[tuple[int, Optional[LayerKV]]]]:
        """``prompts`` and their cached prefixes padded to the batch bucket with copies of the last row."""
        extra = self.batch_bucket(len(prompts)) - len(prompts)
        return prompts + [prompts[-1]] * extra, cached + [cached[-1]] * extra

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: Optional[DynamicCache], params: SamplingParams,
        stop_token_ids: set[int],
    ) -> tuple[torch.Tensor, torch.Tensor, StaticCache]:
        """Sampled tokens [B, n], their behaviour log-probs [B, n] and the static cache, for rows laid out
        by ``batch_inputs`` (``prefix`` holds their cached columns, if any); ``generate`` samples with
        ``torch.multinomial``."""
        bucket = (input_ids.shape[0], self.length_bucket(input_ids.shape[1] + params.max_new_tokens))
        past = self.static_cache(bucket, prefix)
        config = CompileConfig(fullgraph=False, dynamic=False, backend=self.backend, mode=self.mode())
        config._compile_all_devices = True  # transformers compiles on CUDA only unless this is set
        start = time.perf_counter()
        # Without autocast: under it (bf16-mixed training) a Qwen2 layer's keys come out float32 (the rotary
        # embedding's float32 tables) and its values bfloat16, and a StaticCache holds one dtype
        # (transformers raises in index_copy_). So this path decodes in the parameters' dtype.
        device_type = input_ids.device.type
        with torch.autocast(device_type, enabled=False):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=past,
                do_sample=not params.greedy,
                temperature=params.temperature if not params.greedy else None,
                top_p=params.top_p if not params.greedy else None,
                top_k=params.top_k or None if not params.greedy else None,
                min_p=params.min_p or None if not params.greedy else None,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=sorted(stop_token_ids),
                pad_token_id=self.tokenizer.pad_token_id,
                stop_strings=params.stop or None,
                tokenizer=self.tokenizer if params.stop else None,
                return_dict_in_generate=True,
                output_logits=True,
                compile_config=config,
                disable_compile=False,
            )
        if bucket not in self.first_call_s:
            self.first_call_s[bucket] = time.perf_counter() - start
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        scale = params.temperature if not params.greedy else 1.0
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        return new_tokens, logprobs, out.past_key_values

    def static_cache(self, bucket: tuple[int, int], prefix: Optional[DynamicCache]) -> StaticCache:
        """This bucket's static cache, reset, holding ``prefix`` (the batch's cached prefixes, if any)
        in its first columns."""
        length = bucket[1]
        cache = self.static_caches.get(bucket)
        if cache is None:
            cache = self.static_caches[bucket] = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            cache.reset()
        if prefix is not None:
            for layer, (keys, values) in zip(cache.layers, ((lay.keys, lay.values) for lay in prefix.layers)):
                if not layer.is_initialized:
                    layer.lazy_initialization(keys, values)
                columns = keys.shape[2]
                layer.keys[:, :, :columns].copy_(keys)
                layer.values[:, :, :columns].copy_(values)
                layer.cumulative_length.fill_(columns)
        return cache

    def metrics(self) -> dict[str, float]:
        """The buckets compiled so far and the seconds their first calls took."""
        return {
            "perf/hf_compiled_buckets": float(len(self.first_call_s)),
            "perf/hf_compile_first_call_s": float(sum(self.first_call_s.values())),
        }

    def stats(self) -> dict:
        """The buckets, their first calls' seconds (compilation included) and dynamo's count of distinct graphs."""
        from torch._dynamo.utils import counters

        return {
            "compile": True,
            "mode": self.mode(),
            "buckets": [list(b) for b in self.first_call_s],
            "first_call_s": {f"{b}x{n}": round(t, 3) for (b, n), t in self.first_call_s.items()},
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
        }
