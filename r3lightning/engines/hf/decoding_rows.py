"""The rows a decoding loop still runs: finished rows dropped from the batch, and put back at the end."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache


class DecodingRows:
    """Which of a call's ``rows`` the decoding loop still runs.

    Completions end at different lengths; a loop that keeps finished rows in the batch multiplies every
    weight by them until the longest one ends. Here finished rows are dropped from the batch and their
    keys and values set aside (``drop``), so later steps run the live rows only, and ``restore`` puts
    them back: the cache then holds every row as if none had been dropped (the columns a dropped row
    never wrote are zero; nothing reads them, its sequence ends before them). Each row's logits are the
    same computation whichever rows share its batch, so results are equal up to float rounding.

    active: indices [A] (long) of the rows still run, None while no row has been dropped.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self.active: Optional[torch.Tensor] = None
        self.set_aside: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    @property
    def count(self) -> int:
        """Rows run at the next step."""
        return self.rows if self.active is None else len(self.active)

    def of(self, values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``values`` [rows, ...] at the rows still run: [A, ...] (None stays None)."""
        if values is None or self.active is None:
            return values
        return values.index_select(0, self.active)

    def spread(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Values of the rows run [A, ...] as [rows, ...], ``fill`` at the dropped rows."""
        if self.active is None:
            return values
        full = values.new_full((self.rows, *values.shape[1:]), fill)
        full[self.active] = values
        return full

    def worth_dropping(self, finished: torch.Tensor) -> bool:
        """Whether enough of the rows run have finished (``finished`` [rows] bool) to drop them now: an
        eighth of them, at least one (each drop copies the live rows' keys and values once)."""
        done = int(self.of(finished).sum())
        return done > 0 and done >= self.count // 8

    def drop(self, finished: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Drop the rows run that ``finished`` [rows] marks: each cache layer (``GrowingLayer``) keeps the
        others and their keys and values are set aside. Returns the kept rows' positions [K] among the
        rows run before the drop, to select the step's other per-row tensors with."""
        live = ~self.of(finished)
        local, gone = live.nonzero().squeeze(1), (~live).nonzero().squeeze(1)
        before = self.active if self.active is not None else torch.arange(self.rows, device=self.device)
        stashed = [(layer.keys.index_select(0, gone), layer.values.index_select(0, gone)) for layer in cache.layers]
        self.set_aside.append((before[gone], stashed))
        for layer in cache.layers:
            layer.keep_rows(local)
        self.active = before[local]
        return local

    def restore(self, cache: DynamicCache) -> None:
        """Put the dropped rows back into ``cache``: every layer holds [rows, kv_heads, L, head_dim] again."""
        if not self.set_aside:
            return
        for index, layer in enumerate(cache.layers):
            keys = layer.keys.new_zeros((self.rows, *layer.keys.shape[1:]))
            values = layer.values.new_zeros((self.rows, *layer.values.shape[1:]))
            keys[self.active], values[self.active] = layer.keys, layer.values
            for rows, stashed in self.set_aside:
                written = stashed[index][0].shape[-2]
                keys[rows, :, :written], values[rows, :, :written] = stashed[index]
            layer.hold(keys, values, keys.shape[-2])
        self.active, self.set_aside = None, []
