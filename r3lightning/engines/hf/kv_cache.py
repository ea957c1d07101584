"""The ``hf`` engine's key/value caches: ``GrowingLayer`` (a transformers cache layer that appends in place),
``PrefixKVCache`` (the KV of finished sequences, for prompts that extend them) and ``batch_inputs``, which
lays out a batch whose rows start from cached prefixes of different lengths."""

from __future__ import annotations

import functools
from array import array
from collections import Counter, OrderedDict
from typing import Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [kv_heads, L, head_dim]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare capacity instead of concatenating.

    ``DynamicLayer.update`` is ``torch.cat([cache, new])``: every decoding step copies the whole cache
    of every layer, an O(context) copy per generated token that no batch size amortizes (in multi-turn
    episodes with long contexts, a sixth of the agent loop's time). Here the keys and values live
    in a buffer of ``capacity`` columns (doubled when full) and the layer's ``keys`` / ``values`` are
    views of its first columns, so a step writes one column. Attention reads the same values either way.
    Methods that replace ``keys`` (``crop`` keeps a view of the buffer; ``batch_select_indices`` makes a
    new tensor) stay correct: a ``keys`` that is no longer a view of the buffer is copied into a new one.
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self._buffer: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        buffer = self._buffer
        fits = (
            buffer is not None
            and buffer[0].shape[-2] >= end
            and buffer[0].shape[:2] == key_states.shape[:2]
            and buffer[1].shape[:2] == value_states.shape[:2]
            and (length == 0 or (self.keys.data_ptr() == buffer[0].data_ptr() and self.values.data_ptr() == buffer[1].data_ptr()))
        )
        if not fits:
            capacity = max(self.capacity, 2 * end, 64)
            keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if length:
                keys[:, :, :length] = self.keys
                values[:, :, :length] = self.values
            buffer = self._buffer = (keys, values)
        buffer[0][:, :, length:end] = key_states
        buffer[1][:, :, length:end] = value_states
        self.keys, self.values = buffer[0][:, :, :end], buffer[1][:, :, :end]
        return self.keys, self.values

    def hold(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        """Take ``keys`` / ``values`` [B, KVH, C, D] as this layer's buffers, their first ``filled`` columns written."""
        self.lazy_initialization(keys, values)
        self._buffer = (keys, values)
        self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]

    def fixed_buffer(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers [B, KVH, capacity, D] holding this layer's columns, for steps that
        write into them directly (``FusedDecoder.step_static``): exactly ``capacity`` columns (static
        shapes for ``torch.compile``), zero beyond the filled ones (attention reads them, masked)."""
        length = self.keys.shape[-2]
        buffer = self._buffer
        if buffer is None or buffer[0].shape[-2] != capacity or self.keys.data_ptr() != buffer[0].data_ptr():
            keys = self.keys.new_zeros((*self.keys.shape[:2], capacity, self.keys.shape[-1]))
            values = self.values.new_zeros((*self.values.shape[:2], capacity, self.values.shape[-1]))
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
            buffer = self._buffer = (keys, values)
        else:
            buffer[0][:, :, length:].zero_()
            buffer[1][:, :, length:].zero_()
        self.capacity = capacity
        self.keys, self.values = buffer[0][:, :, :length], buffer[1][:, :, :length]
        return buffer

    def cover(self, end: int) -> None:
        """Make ``keys`` / ``values`` the buffer's first ``end`` columns (after direct writes)."""
        self.keys, self.values = self._buffer[0][:, :, :end], self._buffer[1][:, :, :end]

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index`` [K] (long), spare capacity included, so later steps append in place."""
        filled = self.keys.shape[-2]
        buffer = self._buffer
        keys, values = buffer if buffer is not None and self.keys.data_ptr() == buffer[0].data_ptr() else (self.keys, self.values)
        self.hold(keys.index_select(0, index), values.index_select(0, index), filled)


def growing_cache(capacity: int, layers: Optional[LayerKV] = None, filled: int = 0) -> DynamicCache:
    """A ``DynamicCache`` of ``GrowingLayer`` s with room for ``capacity`` tokens; with ``layers``
    (batch keys / values per layer, [B, kv_heads, capacity, head_dim]), those are its buffers, their
    first ``filled`` columns written (no copy: a batch-64 multi-turn call's context is megabytes)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(GrowingLayer, capacity)
    for keys, values in layers or []:
        layer = GrowingLayer(capacity)
        layer.hold(keys, values, filled)
        cache.layers.append(layer)
    return cache


def long_tensor(values) -> torch.Tensor:
    """``values`` (a list or ``array("q")`` of ints) as a CPU int64 tensor [N]. Through an ``array``:
    ``torch.tensor`` converts a list of Python ints element by element, ~4x slower (a 600-token prompt:
    33 us against 9 us), and a batch-64 multi-turn call converts a few hundred such lists."""
    values = values if isinstance(values, array) else array("q", values)
    return torch.frombuffer(values, dtype=torch.long) if len(values) else torch.empty(0, dtype=torch.long, device="cpu")


class PrefixKVCache:
    """Key/value tensors of finished sequences, keyed by their token ids, least recently used first out.

    A multi-turn episode's next prompt is its previous prompt + completion + the new observation, so
    the longest stored sequence that prefixes a prompt covers all but the newest tokens. Holds at most
    ``max_tokens`` tokens in all. Lookups compare one hash per stored length, not token lists: the
    prompt's prefix hashes come from one vectorized cumulative sum (of token x a random weight per
    position, wrapping in int64); a hash match is then confirmed on the tokens.
    """

    def __init__(self, max_tokens: int, seed: int = 0) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], tuple[int, LayerKV]] = OrderedDict()  # key -> (hash, kv)
        self.by_hash: dict[tuple[int, int], tuple[int, ...]] = {}  # (length, hash) -> key
        self.lengths: Counter[int] = Counter()
        self.tokens = 0
        self._generator = torch.Generator().manual_seed(seed)
        # Hashing stays on the CPU whatever the default device (Lightning builds the engine under
        # ``trainer.init_module()``, which makes new tensors land on the GPU).
        self._weights = torch.empty(0, dtype=torch.long, device="cpu")

    def _weighted(self, token_ids: list[int]) -> torch.Tensor:
        if len(token_ids) > len(self._weights):
            extra = torch.randint(-(2**62), 2**62, (max(len(token_ids), 1024) - len(self._weights),), generator=self._generator)
            self._weights = torch.cat([self._weights, extra])
        return long_tensor(token_ids) * self._weights[: len(token_ids)]

    def longest_prefix(self, prompt: list[int]) -> tuple[int, Optional[LayerKV]]:
        """(length, kv) of the longest stored sequence that is a proper prefix of ``prompt`` (at least
        one prompt token is left to prefill: generation needs the last prompt token's logits)."""
        if not self.entries or len(prompt) < 2:
            return 0, None
        hashes = torch.cumsum(self._weighted(prompt[:-1]), dim=0).tolist()  # hashes[i]: prompt[: i + 1]
        for length in sorted((n for n in self.lengths if n < len(prompt)), reverse=True):
            key = self.by_hash.get((length, hashes[length - 1]))
            if key is not None and tuple(prompt[:length]) == key:
                self.entries.move_to_end(key)
                return length, self.entries[key][1]
        return 0, None

    def put(self, token_ids: list[int], kv: LayerKV) -> None:
        key = tuple(token_ids)
        if not key or len(key) > self.max_tokens:
            return
        if key in self.entries:
            self._remove(key)
        digest = int(self._weighted(token_ids).sum())
        self.entries[key] = (digest, kv)
        self.by_hash[(len(key), digest)] = key
        self.lengths[len(key)] += 1
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self.entries)))

    def _remove(self, key: tuple[int, ...]) -> None:
        digest, _ = self.entries.pop(key)
        self.by_hash.pop((len(key), digest), None)
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]
        self.tokens -= len(key)

    def clear(self) -> None:
        self.entries.clear()
        self.by_hash.clear()
        self.lengths.clear()
        self.tokens = 0

    def put_rows(self, sequences: list[list[int]], attention_mask: torch.Tensor, cache: DynamicCache) -> None:
        """Keep each row's KV for its sequence: prompt + completion minus its last token (never fed to the
        model), ``attention_mask`` [B, W] marking the prompt's columns of ``cache`` (whose layers keep
        every column: full attention).

        The rows' entries are views of one tensor gathered for the whole call, so that tensor lives
        until the last of them is evicted; entries of one call are stored together and age together, so
        in practice they leave the cache together."""
        # Each row keeps its attended prompt columns and the columns of its fed completion tokens,
        # gathered for all rows at once (one index per layer) and cut per row.
        width = attention_mask.shape[1]
        device = attention_mask.device
        lengths = [len(sequence) for sequence in sequences]
        row_lengths = long_tensor(lengths).to(device)
        attended = attention_mask.sum(dim=1)  # [B] prompt columns per row
        prompt_columns = torch.argsort(attention_mask == 0, dim=1, stable=True)  # attended columns first, in order
        j = torch.arange(max(max(lengths), 1), device=device)[None]  # [1, longest]
        index = torch.where(
            j < attended[:, None],
            prompt_columns.gather(1, j.clamp(max=width - 1).expand(len(sequences), -1)),
            width + j - attended[:, None],  # completion columns follow the cached width
        )
        index = torch.where(j < row_lengths[:, None], index, 0)  # [B, longest]
        rows = torch.arange(len(sequences), device=device)[:, None]
        gathered = [
            (layer.keys[rows, :, index].transpose(1, 2), layer.values[rows, :, index].transpose(1, 2))  # [B, KVH, longest, D]
            for layer in cache.layers
        ]
        for row, sequence in enumerate(sequences):
            kv = [(keys[row, :, : lengths[row]], values[row, :, : lengths[row]]) for keys, values in gathered]
            self.put(sequence, kv)


def batch_inputs(
    prompts: list[list[int]], cached: list[tuple[int, Optional[LayerKV]]], pad_token_id: int, device: torch.device,
    new_tokens: int = 0, full_attention_only: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[DynamicCache]]:
    """Token ids and attention mask [B, C + S] and the batch cache of length C.

    Row i is laid out as ``pad | cached prefix (c_i) | pad | uncached suffix``: the cached parts are
    left-padded to the longest cached prefix C and the suffixes to the longest suffix S, so every
    row ends at the same column and decoding appends in lockstep. Padding in the middle is only
    masked out; position ids follow the mask, so each row sees itself as unpadded. ``cached`` holds
    each row's (cached length, per-layer KV or None); the cache has room for ``new_tokens`` more
    columns. Without ``full_attention_only`` (models with sliding-window or linear-attention
    layers) and nothing cached, the cache is None: the model builds its own.
    """
    pad = pad_token_id
    cache_width = max(n for n, _ in cached)
    suffix_width = max(len(p) - n for p, (n, _) in zip(prompts, cached))
    width = cache_width + suffix_width
    ids = array("q")
    for prompt, (n, _) in zip(prompts, cached):
        ids.extend([pad] * (cache_width - n) + prompt[:n] + [pad] * (suffix_width - (len(prompt) - n)) + prompt[n:])
    input_ids = long_tensor(ids).view(len(prompts), width)
    cached_lengths = long_tensor([n for n, _ in cached])[:, None]
    suffix_lengths = long_tensor([len(p) for p in prompts])[:, None] - cached_lengths
    column = torch.arange(width, device="cpu")[None]
    attended = ((column >= cache_width - cached_lengths) & (column < cache_width)) | (column >= width - suffix_lengths)
    attention_mask = attended.long()
    if cache_width == 0:
        past = growing_cache(width + new_tokens) if full_attention_only else None
        return input_ids.to(device), attention_mask.to(device), past
    # Rows that share a cached prefix (a group's prompt, one prefix-cache entry) are filled in one copy.
    rows_of: dict[int, tuple[int, LayerKV, list[int]]] = {}
    for row, (n, kv) in enumerate(cached):
        if kv is not None:
            rows_of.setdefault(id(kv), (n, kv, []))[2].append(row)
    groups = [(n, kv, torch.tensor(rows)) for n, kv, rows in rows_of.values()]
    # The cache's buffers are allocated at their final width and the prefixes written into them once.
    capacity = max(width + new_tokens, 64)
    layers = []
    for layer, (ref_k, ref_v) in enumerate(groups[0][1]):
        keys = ref_k.new_zeros((len(prompts), ref_k.shape[0], capacity, ref_k.shape[2]))
        values = ref_v.new_zeros((len(prompts), ref_v.shape[0], capacity, ref_v.shape[2]))
        for n, kv, rows in groups:
            keys[rows, :, cache_width - n : cache_width] = kv[layer][0]
            values[rows, :, cache_width - n : cache_width] = kv[layer][1]
        layers.append((keys, values))
    return input_ids.to(device), attention_mask.to(device), growing_cache(capacity, layers, filled=cache_width)
