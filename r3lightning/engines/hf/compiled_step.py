"""The fused decoding step compiled with ``torch.compile``, over fixed-size key/value buffers.

Eager, a decoding step of a small model is mostly dispatch: ~150 operations of ~10 us each around a
dozen matmuls. Compiled (inductor, static shapes), the elementwise work between the matmuls and the
sampler become a few generated kernels: the GRPO benchmark's rollout (64 rows x 32 tokens of a 3.0M
Qwen2, 2-core CPU) took 0.74x the eager fused step's time (docs/engines.md). Static shapes need a
fixed cache size, so every call's key/value buffers are ``column_bucket`` columns wide and attention
reads all of them, the unwritten ones masked.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from r3lightning.engines.hf.fused_step import FusedDecoder
from r3lightning.engines.hf.sampling import next_tokens

COLUMN_BUCKET = 64  # buffers are a multiple of this many columns: a few graphs per run, little masked work


def column_bucket(columns: int) -> int:
    """The buffer width for ``columns`` columns: the next multiple of ``COLUMN_BUCKET``."""
    return -(-columns // COLUMN_BUCKET) * COLUMN_BUCKET


class CompiledFusedStep:
    """``torch.compile`` of ``decoder.step_static`` followed by ``next_tokens`` (the pick of the next
    token and its log-prob, so the sampler's dozen small operations join the graph).

    The first graph has static shapes; when a call brings another batch size or buffer width, dynamo
    compiles a graph with those sizes symbolic (its automatic dynamic shapes) that serves every later
    size, so an agent loop whose batch shrinks as episodes end and whose contexts grow turn by turn
    compiles a few graphs, not one per shape (44 shapes, 3 graphs in the agent-loop benchmark). A
    temperature or truncation (top_p, top_k, min_p) not seen before compiles anew (they are constants in the graph). After
    ``max_graphs`` compilations a call of an unseen shape is refused (``accepts`` is False: the
    caller decodes eagerly and counts it), so nothing compiles without end.
    """

    def __init__(self, decoder: FusedDecoder, backend: str = "inductor", mode: Optional[str] = None, max_graphs: int = 8) -> None:
        self.decoder = decoder
        self.max_graphs = max_graphs
        # On the CPU, inductor's C++ wrapper launches the graph's ~60 kernels and matmuls without its
        # Python wrapper's per-call overhead: ~5 ms less per 32-token GRPO rollout, the same compile
        # time with a warm cache. torch.compile takes ``options`` or ``mode``, not both.
        on_cpu = next(decoder.model.parameters()).device.type == "cpu"
        options = {"cpp_wrapper": True} if backend == "inductor" and mode is None and on_cpu else None
        self.fn = torch.compile(self._step_and_pick, backend=backend, mode=mode, options=options)  # dynamic=None: automatic dynamic shapes
        self.graphs = 0  # graphs dynamo compiled for this step
        self.shapes: set[tuple[int, int, float, tuple[float, int, float]]] = set()  # (rows, columns, temperature, (top_p, top_k, min_p)) seen
        self.compile_s: dict[tuple[int, int, float, tuple[float, int, float]], float] = {}  # shape -> seconds of the call that compiled for it

    def _step_and_pick(self, token_ids, positions, column, buffers, attention_mask, draw, temperature: float, truncation: tuple[float, int, float]):
        logits = self.decoder.step_static(token_ids, positions, column, buffers, attention_mask).float()
        top_p, top_k, min_p = truncation
        return next_tokens(logits, temperature, top_p, draw, top_k, min_p)

    def accepts(self, shape: tuple[int, int, float, tuple[float, int, float]]) -> bool:
        return shape in self.shapes or self.graphs < self.max_graphs

    def __call__(self, token_ids, positions, column, buffers, attention_mask, draw, temperature: float, truncation: tuple[float, int, float]):
        """Token [B] and log-prob [B] after ``token_ids`` (see ``FusedDecoder.step_static`` and ``next_tokens``).

        Graphs are counted on every call, not only for new shapes: dynamo also recompiles a known shape
        when another guard fails (an input's strides, say), and such a compilation must show."""
        shape = (token_ids.shape[0], attention_mask.shape[-1], temperature, truncation)
        graphs_before, start = compiled_graphs(), time.perf_counter()
        picked = self.fn(token_ids, positions, column, buffers, attention_mask, draw, temperature, truncation)
        self.shapes.add(shape)
        new_graphs = compiled_graphs() - graphs_before
        if new_graphs:
            self.graphs += new_graphs
            self.compile_s[shape] = self.compile_s.get(shape, 0.0) + time.perf_counter() - start
        return picked


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StaticDecoding:
    """The decoding steps of one generate call through a ``CompiledFusedStep``.

    ``buffers`` are the cache's per-layer key/value buffers [B, KVH, C, D] whose first ``filled``
    columns hold the context; ``context_mask`` [B, 1, 1, filled] is the additive mask over them (0
    where a row attends, the dtype's minimum on padding). Each ``step`` writes the next column and
    unmasks it first (the new token attends to itself); columns beyond it stay masked.
    """

    def __init__(self, step: CompiledFusedStep, buffers: list[tuple[torch.Tensor, torch.Tensor]], context_mask: torch.Tensor, filled: int) -> None:
        rows, capacity = buffers[0][0].shape[0], buffers[0][0].shape[2]
        self.step_fn, self.buffers, self.filled = step, buffers, filled
        self.mask = torch.full((rows, 1, 1, capacity), torch.finfo(context_mask.dtype).min, dtype=context_mask.dtype, device=context_mask.device)
        self.mask[..., :filled] = context_mask
        self.column = torch.tensor([filled], device=context_mask.device)

    def step(self, token_ids: torch.Tensor, positions: torch.Tensor, draw: Optional[torch.Tensor], temperature: float, truncation: tuple[float, int, float]):
        """The next token [B] and its log-prob [B] after ``token_ids`` [B] at ``positions`` [B] (``draw``:
        the sampler's uniforms [B, 1], None when greedy); their keys and values fill the next column."""
        self.mask[..., self.filled] = 0.0
        # Contiguous inputs: the first step's positions are a column of the prompts' [B, W] positions,
        # and a graph compiled for that stride would be compiled again for the next steps' [B].
        token_ids, positions = token_ids.contiguous(), positions.contiguous()
        picked = self.step_fn(token_ids, positions, self.column, self.buffers, self.mask, draw, temperature, truncation)
        self.column += 1
        self.filled += 1
        return picked
