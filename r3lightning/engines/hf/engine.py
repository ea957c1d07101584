"""The ``hf`` engine: decoding on the live policy module (no weight sync needed), with the KV cache of
each finished sequence kept so that the next turn of a multi-turn episode prefills only its new tokens.
The caches are in ``kv_cache``, the fused and compiled decoding steps in ``fused_step`` and
``compiled_step``, transformers' compiled ``generate`` in ``generate_compiled``."""

from __future__ import annotations

import logging
from typing import Literal, Optional, get_args

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation.stopping_criteria import StopStringCriteria

from r3lightning.engines.base import Generation, SamplingParams, truncate_at_stop
from r3lightning.engines.compile_cache import compile_cache_counts, use_compile_cache
from r3lightning.engines.hf.compiled_step import CompiledFusedStep, StaticDecoding, column_bucket
from r3lightning.engines.hf.fused_step import FusedDecoder, fused_decode_unsupported
from r3lightning.engines.hf.generate_compiled import CompiledGenerate
from r3lightning.engines.hf.decoding_rows import DecodingRows
from r3lightning.engines.hf.kv_cache import GrowingLayer, LayerKV, PrefixKVCache, batch_inputs, long_tensor
from r3lightning.engines.hf.sampling import next_tokens

log = logging.getLogger(__name__)

HFDecode = Literal["forward", "fused", "fused_compiled", "generate_compiled"]
"""The ``hf`` engine's decoding paths (``HFEngine``'s ``decode``)."""
MatmulDtype = Literal["auto", "parameters", "bfloat16"]
"""The fused decoding step's matmul dtype (``HFEngine``'s ``matmul_dtype``)."""


def decoding_matmul_dtype(choice: str, device_type: str) -> Optional[torch.dtype]:
    """The fused step's matmul dtype for a ``generate`` call (None: the parameters'): ``bfloat16``
    always; ``auto`` bfloat16 when the call runs inside a bfloat16 autocast on ``device_type`` (the
    trainer's ``bf16-mixed``, under which the trainer's own linears multiply in bfloat16); ``parameters``
    never."""
    if choice == "bfloat16":
        return torch.bfloat16
    if choice == "auto" and torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16:
        return torch.bfloat16
    return None


class HFEngine:
    """Batched sampling on the very module being trained: the engine's own decoding loop, or transformers'
    compiled ``generate`` (``decode``).

    Because it shares the trainer's parameters, every rollout sees the latest optimizer step;
    ``weight_version`` is advanced by the module after each step for bookkeeping only.

    Args:
        model: the policy (a transformers causal LM).
        tokenizer: its tokenizer (eos = end of turn, pad token set).
        max_batch_size: prompts per ``generate`` call (bounds activation memory).
        prefix_cache: keep each finished sequence's KV cache and reuse it for prompts that extend it
            (the next turn of an episode, a retry that replays a prefix). Entries are dropped whenever
            any parameter changes (an optimizer step, a checkpoint load), detected from the tensors'
            storages and in-place version counters, so reuse never mixes weights. A call's sequences
            are cut into entries at the start of the next call, and only if the weights are still the
            same (``flush_prefix_cache`` does it at once): between GRPO's single-turn rollouts an
            optimizer step always comes, and the cut (~5 ms of a 64-row rollout) would be thrown away.
        max_cached_tokens: most tokens the prefix cache holds, over all sequences.
        decode: how tokens are decoded (``engine.hf_decode`` less its ``auto``). ``forward``: the
            model's forward every step. ``fused``: steps that feed one token per row run
            ``FusedDecoder`` (the model's own modules with query/key/value and gate/up projections
            fused, grouped-query attention, one prepared mask) instead of the model's forward, for
            llama, qwen2 and qwen3 models, and on the CPU the prefill runs ``FusedDecoder.prefill``;
            others keep the forward (each such call counted in ``perf/hf_fused_decode_off``). Holds a
            copy of the fused projections' weights (most of the model's) while they are current.
            ``fused_compiled``: as ``fused``, with the one-token decoding steps and the sampler run by
            ``CompiledFusedStep``: ``FusedDecoder.step_static`` and ``next_tokens`` compiled with
            ``torch.compile`` (``compile_backend``, ``compile_mode``) over the cache's buffers widened
            to a multiple of 64 columns; static shapes first, then one graph with the batch size and
            width symbolic (dynamo's automatic dynamic shapes); after 8 graphs, calls of unseen shapes
            decode eagerly, counted in ``fused_compile_skipped``. ``generate_compiled``: transformers'
            ``generate`` with its ``StaticCache`` and ``torch.compile`` of the decoding step (the
            prefill stays eager; a prompt shared by several rows is encoded first, as under ``fused``).
            Shapes are bucketed so a run compiles a handful of times: the batch is padded to a power of
            two (at most ``max_batch_size``) with copies of its last prompt, whose completions are
            dropped, and the cache length (prompt + new tokens) is rounded up to a power of two (at
            least 64). Static caches are kept per bucket and reset before each use (CUDA graphs need
            fixed addresses).
        compile_mode: ``torch.compile`` mode of the compiled paths (``reduce-overhead``: CUDA graphs,
            ``default``, ``max-autotune-no-cudagraphs``...); None: for ``generate_compiled``
            ``reduce-overhead`` on CUDA and ``default`` elsewhere, for ``fused_compiled`` torch's default.
        compile_backend: ``torch.compile`` backend (``inductor``; tests use ``eager``, which traces the
            same graphs in seconds without generating code).
        drop_finished_rows: ``fused``: drop rows that finished from the decoding batch and put them back
            when the call ends (``DecodingRows``); results equal up to float rounding.
        matmul_dtype: ``fused`` and ``fused_compiled``: the dtype of the projections' and LM head's
            matmuls (``decoding_matmul_dtype``): ``auto`` bfloat16 inside a bfloat16 autocast (the
            trainer's ``bf16-mixed``; the matmuls then read bfloat16 copies of the weights and round as
            the trainer's autocast linears do), else the parameters' dtype; ``parameters`` always the
            parameters' dtype; ``bfloat16`` always bfloat16. Norms, attention, the KV cache and the
            sampler stay in the parameters' dtype. The forward (``forward``, ``generate_compiled``,
            models the fused step does not cover) decodes in the parameters' dtype. Whether the last
            call's steps ran bfloat16 matmuls is logged as ``perf/hf_matmul_bfloat16``.
        compile_cache_dir: the compiled paths: where inductor keeps its compiled artefacts across
            runs (``engines/compile_cache.py``); empty: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
            ``~/.cache/r3lightning/torchinductor``. Lookups are logged as ``perf/compile_cache_hits`` and
            ``perf/compile_cache_misses``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        max_batch_size: int = 64,
        prefix_cache: bool = True,
        max_cached_tokens: int = 65536,
        decode: HFDecode = "fused",
        compile_mode: Optional[str] = None,
        compile_backend: str = "inductor",
        compile_cache_dir: str = "",
        drop_finished_rows: bool = True,
        matmul_dtype: MatmulDtype = "auto",
    ) -> None:
        if decode not in get_args(HFDecode):
            raise ValueError(f"HFEngine: decode must be one of {', '.join(get_args(HFDecode))}, got {decode!r}")
        if matmul_dtype not in get_args(MatmulDtype):
            raise ValueError(f"HFEngine: matmul_dtype must be one of {', '.join(get_args(MatmulDtype))}, got {matmul_dtype!r}")
        self.matmul_dtype = matmul_dtype
        self._call_matmul_dtype: Optional[torch.dtype] = None  # this call's, from decoding_matmul_dtype
        self._bfloat16_steps = False  # whether the last call's fused steps multiplied in bfloat16
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.stop_token_ids = {tokenizer.eos_token_id}
        self.prefix_cache = PrefixKVCache(max_cached_tokens) if prefix_cache else None
        self._weights_state: tuple = ()
        self._cached_under: Optional[tuple] = None
        self._unstored: Optional[tuple] = None  # the last call's (sequences, attention mask, cache) for _store
        self.stats = {"prompt_tokens": 0, "reused_prompt_tokens": 0, "prefix_cache_unsupported": 0, "fused_decode_off": 0, "fused_compile_skipped": 0,
                      "decoded_row_steps": 0, "batch_row_steps": 0}
        self.decode = decode
        self.drop_finished_rows = drop_finished_rows
        self._fused: Optional[FusedDecoder] = None
        self._fused_off_reason: Optional[str] = None
        self._compiled_step: Optional[CompiledFusedStep] = None
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self.compiles = decode in ("fused_compiled", "generate_compiled")
        if self.compiles:
            use_compile_cache(compile_cache_dir)
        self._plain_layers: Optional[bool] = None
        self.compiled_generate = (
            CompiledGenerate(model, tokenizer, max_batch_size, compile_mode, compile_backend) if decode == "generate_compiled" else None
        )

    def cache_hit_rate(self) -> float:
        """Share of all prompt tokens so far whose KV came from the prefix cache."""
        return self.stats["reused_prompt_tokens"] / max(self.stats["prompt_tokens"], 1)

    def metrics(self) -> dict[str, float]:
        """Figures the module logs each step: the cache hit rate so far, and how often the model's
        cache type forced the prefix cache off (a fallback to full prefill) and how many generate calls
        decoded with the model's forward although fused decoding was asked for; under ``fused`` with a model
        of ``fused_step.PACKED_MIN_HIDDEN`` hidden units or more, whether its projections ran packed oneDNN linears
        (``perf/hf_packed_linears``, 0 off a CPU float32 model or without oneDNN); with ``generate_compiled``, the
        shape buckets compiled so far and the seconds their first calls took; with ``fused_compiled``,
        the compiled step's graphs, the seconds of the calls that compiled them and the calls refused one."""
        figures = {
            "perf/prefix_cache_hit_rate": self.cache_hit_rate(),
            "perf/prefix_cache_unsupported": float(self.stats["prefix_cache_unsupported"]),
            "perf/hf_fused_decode_off": float(self.stats["fused_decode_off"]),
        }
        if self.stats["batch_row_steps"]:
            # decoding steps x rows actually run, over steps x the call's rows (1.0: no finished row was dropped)
            figures["perf/hf_decoded_row_share"] = self.stats["decoded_row_steps"] / self.stats["batch_row_steps"]
        fused = self._fused
        if fused is not None and fused.pack and fused.wide:
            # Packed oneDNN linears were possible for this width: 0 says they were off (not a CPU float32 model, no oneDNN).
            figures["perf/hf_packed_linears"] = float(fused.packed)
        if self.decode in ("fused", "fused_compiled"):
            figures["perf/hf_matmul_bfloat16"] = float(self._bfloat16_steps)
        if self.compiled_generate is not None:
            figures.update(self.compiled_generate.metrics())
        if self.decode == "fused_compiled":
            step = self._compiled_step
            figures["perf/hf_fused_compile_graphs"] = float(step.graphs if step is not None else 0)
            figures["perf/hf_fused_compile_s"] = float(sum(step.compile_s.values()) if step is not None else 0)
            figures["perf/hf_fused_compile_skipped"] = float(self.stats["fused_compile_skipped"])
        if self.compiles:
            figures.update(compile_cache_counts())
        return figures

    def compile_stats(self) -> dict:
        """The compiled path's buckets and their first calls' seconds (compilation included), or the
        compiled fused step's graphs, shapes and the seconds of the calls that compiled; and dynamo's
        count of distinct graphs."""
        from torch._dynamo.utils import counters

        if self.decode == "fused_compiled":
            step = self._compiled_step
            return {
                "fused_compile": True,
                "graphs": step.graphs if step is not None else 0,
                "shapes_seen": len(step.shapes) if step is not None else 0,
                "compile_s": {"x".join(map(str, shape)): round(t, 3) for shape, t in (step.compile_s.items() if step is not None else ())},
                "skipped_calls": self.stats["fused_compile_skipped"],
                "unique_graphs": int(counters["stats"]["unique_graphs"]),
            }
        if self.compiled_generate is None:
            return {"compile": False}
        return self.compiled_generate.stats()

    def _full_attention_only(self) -> bool:
        """Whether every layer of the model's own cache is a plain ``DynamicLayer`` (no sliding window,
        no linear attention), i.e. whether ``GrowingLayer`` can stand in for it."""
        if self._plain_layers is None:
            try:
                layers = DynamicCache(config=self.model.config).layers
                self._plain_layers = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
            except Exception:  # noqa: BLE001 - an unusual config: keep transformers' default cache
                self._plain_layers = False
        return self._plain_layers

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        # Every in-place write (optimizer step, load_state_dict) bumps a tensor's version counter; a load
        # that swaps tensors changes their storage. Read once per call, for the prefix cache and the
        # fused weights alike.
        self._weights_state = tuple((p.data_ptr(), p._version) for p in self.model.parameters())
        # Outside any autocast (bf16-mixed training rolls out inside the trainer's): the engine decodes in
        # its parameters' dtype, the fused step's matmuls in the dtype chosen here from the caller's autocast.
        device_type = next(self.model.parameters()).device.type
        self._call_matmul_dtype = decoding_matmul_dtype(self.matmul_dtype, device_type)
        self._bfloat16_steps = False
        self._drop_stale_cache()
        results: list[Generation] = []
        with torch.autocast(device_type, enabled=False):
            for start in range(0, len(prompts), self.max_batch_size):
                results.extend(self._generate_chunk(prompts[start : start + self.max_batch_size], params))
        return results

    def _drop_stale_cache(self) -> None:
        if self.prefix_cache is None:
            return
        state = (self._weights_state, self._call_matmul_dtype)
        if state != self._cached_under:
            self.prefix_cache.clear()
            self._unstored = None  # computed under other weights or matmul dtype: never reusable
            self._cached_under = state

    def flush_prefix_cache(self) -> None:
        """Cut the last call's sequences into prefix-cache entries now (``generate`` does it at its start)."""
        if self._unstored is not None and self.prefix_cache is not None:
            self._store(*self._unstored)
        self._unstored = None

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        self.flush_prefix_cache()
        device = next(self.model.parameters()).device
        cached = [self.prefix_cache.longest_prefix(p) for p in prompts] if self.prefix_cache else [(0, None)] * len(prompts)
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        self.stats["reused_prompt_tokens"] += sum(n for n, _ in cached)
        rows = len(prompts)
        compiled = self.compiled_generate
        was_training = self.model.training
        self.model.eval()
        try:
            # transformers' compiled generate needs an uncached token per row to start from.
            cached, first_logits = self._share_repeated_prompts(prompts, cached, device, whole=compiled is None)
        finally:
            self.model.train(was_training)
        # The compiled path's padding rows are dropped after generation.
        batch_prompts, batch_cached = (prompts, cached) if compiled is None else compiled.pad(prompts, cached)
        input_ids, attention_mask, past = batch_inputs(
            batch_prompts, batch_cached, self.tokenizer.pad_token_id, device, params.max_new_tokens, self._full_attention_only()
        )
        self.model.eval()
        try:
            if compiled is not None:
                new_tokens, logprobs, cache = compiled.generate(input_ids, attention_mask, past, params, self.stop_token_ids)
            else:
                new_tokens, logprobs, cache = self._decode(input_ids, attention_mask, past, params, first_logits)
        finally:
            self.model.train(was_training)
        if compiled is not None and not all(type(layer) is StaticLayer for layer in cache.layers):
            self.prefix_cache = None  # sliding-window layers keep a ring buffer: no per-row prefix re-padding
        new_tokens, logprobs = new_tokens[:rows].cpu(), logprobs[:rows].float().cpu()
        budget_hit = new_tokens.shape[1] >= params.max_new_tokens
        generations = [
            truncate_at_stop(
                new_tokens[row].tolist(),
                logprobs[row].tolist(),
                self.stop_token_ids,
                params.stop,
                self.tokenizer.decode,
                budget_exhausted=budget_hit,
            )
            for row in range(len(prompts))
        ]
        if self.prefix_cache is not None:
            # The sequences are new lists: the caller may extend its prompt lists before they are stored.
            sequences = [prompt + gen.token_ids[: max(len(gen.token_ids) - 1, 0)] for prompt, gen in zip(prompts, generations)]
            self._unstored = (sequences, attention_mask[:rows], cache)
        return generations

    def _decode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: Optional[DynamicCache], params: SamplingParams,
        first_logits: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """Sampled tokens [B, n], their behaviour log-probs [B, n] and the cache, for rows laid out by
        ``batch_inputs`` (whose first ``past`` columns are cached).

        The decoding loop, in place of ``generate``'s (whose per-step bookkeeping and sampler cost a fifth
        of a rollout at this scale): the uncached columns are prefilled, then every step feeds each row's
        last token at the next position. With ``first_logits`` [B, V] (the logits after each row's whole
        prompt, every column of which is cached: ``_share_repeated_prompts``) the first token is drawn
        from them and nothing is prefilled. Rows that emitted a stop token (or completed a stop string) are
        fed the pad token afterwards; the loop ends when every row has finished or the budget is spent.
        The next token and its log-prob come from ``next_tokens`` (greedy: the arg max; sampling:
        ``sample_tokens``), inside the compiled step with ``fused_compiled``. Only the tokenizer's stop
        tokens end a row: a checkpoint's ``generation_config`` (repetition penalty, its own sampling
        defaults) does not apply, as in the vllm engine, so behaviour log-probs are exactly
        log softmax(logits / temperature), the distribution drawn from when no truncation is set.
        """
        rows = input_ids.shape[0]
        cached = past.get_seq_length() if past is not None else 0
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        step_ids = input_ids[:, cached:]
        # With first_logits every prompt column is cached: start from the last one, so the first fed token sits after it.
        step_positions = positions[:, cached:] if first_logits is None else positions[:, -1:]
        stop_tokens = torch.tensor(sorted(self.stop_token_ids), device=input_ids.device)
        stop_strings = StopStringCriteria(self.tokenizer, params.stop) if params.stop else None
        finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        fused = self._fused_decoder(past)
        first_decode_step = 0 if first_logits is None and step_ids.shape[1] == 1 else 1  # after the prefill, if any
        if fused is not None:
            # Every decoding step's mask, prepared once: [B, 1, 1, width + budget], additive (0 where a
            # row attends, the dtype's minimum on its padding); step s reads its first width + s columns.
            dtype = next(self.model.parameters()).dtype
            additive = torch.zeros((rows, 1, 1, input_ids.shape[1] + params.max_new_tokens), dtype=dtype, device=input_ids.device)
            additive[:, 0, 0, : input_ids.shape[1]].masked_fill_(attention_mask == 0, torch.finfo(dtype).min)
        tokens, logprobs = [], []
        static: Optional[StaticDecoding] = None  # compiled steps, set up at the first one-column step
        dropping = self.drop_finished_rows and fused is not None and self.decode == "fused"
        kept = DecodingRows(rows, input_ids.device)  # the rows still decoded, once finished ones were dropped
        for step in range(params.max_new_tokens):
            draw = None if params.greedy else torch.rand((rows, 1), device=input_ids.device)  # the sampler's uniforms
            draw = kept.of(draw)  # every row draws its uniform, decoded or not: a row's tokens do not depend on the others'
            logits = None  # stays None when the compiled step picked the token itself
            if step == 0 and first_logits is not None:
                logits = first_logits
            elif fused is not None and step_ids.shape[1] == 1:  # one new column per row (the prefill too, after a cache hit)
                if self.decode == "fused_compiled" and static is None and step == first_decode_step:
                    static = self._static_decoding(fused, past, additive, input_ids.shape[1] + params.max_new_tokens, params)
                if static is not None:
                    token, logprob = static.step(step_ids[:, 0], step_positions[:, 0], draw, params.temperature, params.truncation)
                else:
                    logits = fused.step(step_ids[:, 0], step_positions[:, 0], past, additive[..., : input_ids.shape[1] + step]).float()
            elif fused is not None and input_ids.device.type == "cpu":
                # On CUDA the forward prefills: its SDPA kernels take the padding mask directly, and the
                # fused prefill's extra head dimension would push them off their fast paths.
                logits = fused.prefill(step_ids, step_positions, past, attention_mask).float()
            else:
                out = self.model(
                    input_ids=step_ids, attention_mask=attention_mask, position_ids=step_positions,
                    past_key_values=past, use_cache=True, logits_to_keep=1,
                )
                past = out.past_key_values
                logits = out.logits[:, -1].float()
            if logits is not None:
                token, logprob = next_tokens(logits, params.temperature, params.top_p, draw, params.top_k, params.min_p)
            token, logprob = kept.spread(token, self.tokenizer.pad_token_id), kept.spread(logprob, 0.0)
            self.stats["decoded_row_steps"] += kept.count
            self.stats["batch_row_steps"] += rows
            token = token.masked_fill(finished, self.tokenizer.pad_token_id)
            tokens.append(token)
            logprobs.append(logprob)
            finished |= torch.isin(token, stop_tokens)
            if stop_strings is not None:
                finished |= stop_strings(torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1), None)
            if bool(finished.all()) or step + 1 == params.max_new_tokens:
                break
            step_ids, step_positions = kept.of(token).unsqueeze(1), step_positions[:, -1:] + 1
            if dropping and kept.worth_dropping(finished):
                local = kept.drop(finished, past)
                step_ids, step_positions, additive = step_ids[local], step_positions[local], additive[local]
            if fused is None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, 1))], dim=1)
        if static is not None:
            for layer in past.layers:
                layer.cover(static.filled)
        kept.restore(past)
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), past

    def _static_decoding(
        self, fused: FusedDecoder, past: DynamicCache, additive: torch.Tensor, columns: int, params: SamplingParams
    ) -> Optional[StaticDecoding]:
        """This call's compiled decoding steps over the cache's buffers widened to ``column_bucket(columns)``,
        or None for a shape not seen before once the compiled step has compiled its ``max_graphs``
        graphs (then the eager fused step decodes; counted in ``fused_compile_skipped``)."""
        if self._compiled_step is None or self._compiled_step.decoder is not fused:
            self._compiled_step = CompiledFusedStep(fused, backend=self.compile_backend, mode=self.compile_mode)
        capacity = column_bucket(columns)
        if not self._compiled_step.accepts((additive.shape[0], capacity, params.temperature, params.truncation)):
            self.stats["fused_compile_skipped"] += 1
            return None
        filled = past.get_seq_length()
        buffers = [layer.fixed_buffer(capacity) for layer in past.layers]
        return StaticDecoding(self._compiled_step, buffers, additive[..., :filled], filled)

    def _fused_decoder(self, past: Optional[DynamicCache], count_fallback: bool = True) -> Optional[FusedDecoder]:
        """The fused decoding step for this call's decoding steps, or None: not asked for, or a model or
        cache it does not cover (then the model's forward decodes; counted in ``fused_decode_off``
        unless ``count_fallback`` is False: the shared-prompt prefill leaves the count to ``_decode``)."""
        if self.decode == "forward":  # generate_compiled too: its shared-prompt prefill
            return None
        if self._fused is None and self._fused_off_reason is None:
            self._fused_off_reason = fused_decode_unsupported(self.model)
            if self._fused_off_reason is None:
                self._fused = FusedDecoder(self.model, pack=self.decode == "fused")
        if self._fused is not None and past is not None and all(type(layer) is GrowingLayer for layer in past.layers):
            self._fused.refresh(self._weights_state, self._call_matmul_dtype)
            self._bfloat16_steps = self._fused.matmul_dtype == torch.bfloat16
            return self._fused
        if not count_fallback:
            return None
        self.stats["fused_decode_off"] += 1
        if self.stats["fused_decode_off"] == 1:
            reason = self._fused_off_reason or "a cache that is not the engine's own full-attention cache"
            log.warning("hf engine: fused decoding off (%s); the model's forward decodes", reason)
        return None

    def _share_repeated_prompts(
        self, prompts: list[list[int]], cached: list[tuple[int, Optional[LayerKV]]], device: torch.device, whole: bool = True
    ) -> tuple[list[tuple[int, Optional[LayerKV]]], Optional[torch.Tensor]]:
        """Encode a prompt that several rows share (a GRPO group's samples) once, not once per row.

        For every prompt that occurs more than once in the batch, its tokens but the last are run through
        the model once (continuing from its prefix-cache hit, if any), and every row with that prompt
        takes this KV as its cached prefix; ``generate`` then prefills only the last token of each row,
        as for a prefix-cache hit (same numerics: tests/engines/test_hf_engine.py). When some prompt is
        shared (and ``whole``), every distinct prompt, shared or not, is encoded whole and the last
        logits returned per row [B, V] (else None): the first token is drawn from them, the rows skip
        one decoding step over the whole batch, and no row is padded to another's prompt (were only the
        shared ones encoded first, their one-token suffixes would be padded to the longest unshared
        prompt in the batch's prefill: 32 chat prompts, 21 distinct, ran 1,881 prefill positions,
        against 924 encoding the distinct ones whole). On the CPU the fused prefill encodes them when
        the fused step covers the model, as in ``_decode``.
        """
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for row, prompt in enumerate(prompts):
            rows_of.setdefault(tuple(prompt), []).append(row)
        whole = whole and any(len(rows) > 1 for rows in rows_of.values()) and all(prompts)
        # The row groups encoded here: every distinct prompt when whole, else the repeated ones with uncached tokens.
        encoded = [rows for rows in rows_of.values() if whole or (len(rows) > 1 and cached[rows[0]][0] < len(prompts[rows[0]]) - 1)]
        if not encoded:
            return cached, None
        heads = [prompts[rows[0]] if whole else prompts[rows[0]][:-1] for rows in encoded]
        input_ids, attention_mask, past = batch_inputs(
            heads, [cached[rows[0]] for rows in encoded], self.tokenizer.pad_token_id, device, full_attention_only=self._full_attention_only()
        )
        start = past.get_seq_length() if past is not None else 0
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)[:, start:]
        fused = self._fused_decoder(past, count_fallback=False) if device.type == "cpu" else None  # as in _decode
        if fused is not None:
            logits = fused.prefill(input_ids[:, start:], position_ids, past, attention_mask)
            layers = past.layers
        else:
            out = self.model(
                input_ids=input_ids[:, start:],
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past if past is not None else DynamicCache(config=self.model.config),
                use_cache=True,
                logits_to_keep=1,
            )
            logits, layers = out.logits[:, -1], out.past_key_values.layers
        if not all(type(layer) in (DynamicLayer, GrowingLayer) for layer in layers):
            return cached, None  # sliding-window or linear-attention layers: no re-padding per row
        cached = list(cached)
        group_of_row = [0] * len(prompts)
        for index, rows in enumerate(encoded):
            columns = attention_mask[index].nonzero().squeeze(1)
            kv = [(layer.keys[index][:, columns], layer.values[index][:, columns]) for layer in layers]
            for row in rows:
                cached[row] = (len(heads[index]), kv)
                group_of_row[row] = index
        return cached, logits.float()[long_tensor(group_of_row).to(logits.device)] if whole else None

    def _store(self, sequences: list[list[int]], attention_mask: torch.Tensor, cache) -> None:
        """Cut the last call's rows into prefix-cache entries (``PrefixKVCache.put_rows``); a cache whose
        layers do not keep every column switches the prefix cache off, counted."""
        if not all(type(layer) in (DynamicLayer, GrowingLayer, StaticLayer) for layer in cache.layers):
            # Sliding-window or linear-attention caches cannot be cut and re-padded per row.
            self.stats["prefix_cache_unsupported"] += 1
            self.prefix_cache = None
            return
        self.prefix_cache.put_rows(sequences, attention_mask, cache)
