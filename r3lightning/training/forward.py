"""The trainer's forward passes: logits only where a loss reads them, a group's shared prompt encoded once.

``PrefixSharedForward`` runs the policy (or a frozen copy: reference, teacher) over right-padded rows
[b, T] and counts what it ran (``perf/train_forward_token_frac``, ``perf/train_prefix_sharing_off``).
The losses that read its logits are in ``r3lightning.training.loss``.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, NamedTuple, Optional, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from r3lightning import algos
from r3lightning.algos.context_distillation import aligned_predictions, prompt_lengths, splice_prompts
from r3lightning.algos.logprobs import scored_window_start
from r3lightning.types import ExperienceBatch


class WindowScores(NamedTuple):
    """What ``PrefixSharedForward.sequence_logprobs`` returns for rows [b, T] scored from ``start``.

    logp: [b, T-1-start] log-probs of tokens start+1.. at the sampling temperature (with gradient).
    logits: [b, T-1-start, V] the model's own (untempered) logits.
    entropy: [b, T-1-start] entropy at the sampling temperature, no gradient; None unless asked for.
    """

    logp: torch.Tensor
    logits: torch.Tensor
    entropy: Optional[torch.Tensor]


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the sampling distribution (the RL loss scores the samples as they were drawn)."""
    return logits / temperature if temperature != 1.0 else logits


def window_start(batch: ExperienceBatch) -> int:
    """Leading predictions of ``batch`` that no loss reads (RL or SFT tokens)."""
    return scored_window_start((batch.loss_mask > 0) | (batch.sft_mask > 0), batch.attention_mask)


class PrefixSharedForward:
    """Forwards of right-padded rows whose first ``start`` predictions no loss reads.

    sharded: the policy is sharded (FSDP): two forwards of each unit before one backward are not
        allowed there, so the shared prefix is recomputed per row.
    forwarded, in_rows: tokens run through a model vs tokens in the rows, since ``reset_counts``.
    sharing_off: forwards (over the run) whose shared prefix had to be recomputed per row (the fallback).
    """

    def __init__(self) -> None:
        self.sharded = False
        self.forwarded = 0
        self.in_rows = 0
        self.sharing_off = 0

    def reset_counts(self) -> None:
        self.forwarded, self.in_rows = 0, 0

    def token_fraction(self) -> float:
        return self.forwarded / max(self.in_rows, 1)

    def window_logits(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Logits [b, T-1-start, V] of predictions start..T-2 (of tokens start+1..T-1) for right-padded rows
        [b, T] whose first ``start`` tokens are real (``scored_window_start``).

        Logits are computed only where a loss reads them. Rows that share their first ``start`` tokens (a
        GRPO group's prompt) have them encoded once: a forward over the distinct prefixes keeps their keys
        and values, every row reads its prefix's as its cache, and a second forward runs the rest of the
        rows. Gradients flow back through the cache into the prefix's forward, so this is the full forward's
        computation, batched differently (equal up to float rounding: tests/module/test_window_logits.py).
        """
        rows, width = input_ids.shape
        self.in_rows += rows * width
        if start > 0:
            prefixes, row_of = torch.unique(input_ids[:, :start], dim=0, return_inverse=True)
            if len(prefixes) < rows:
                cache = self._empty_shareable_cache(model)
                if cache is not None:
                    model(input_ids=prefixes, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    # index_select, not indexing: its backward adds each prefix's rows in row order at any
                    # thread count; indexing's accumulating backward added them in arrival order at 2 threads.
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys.index_select(0, row_of), layer.values.index_select(0, row_of)
                    self.forwarded += len(prefixes) * start + rows * (width - start)
                    keep = torch.arange(width - 1 - start, device=input_ids.device)
                    return model(
                        input_ids=input_ids[:, start:], attention_mask=attention_mask, past_key_values=cache,
                        use_cache=True, logits_to_keep=keep,
                    ).logits
                self.sharing_off += 1
        self.forwarded += rows * width
        keep = torch.arange(start, width - 1, device=input_ids.device)
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits

    def _empty_shareable_cache(self, model: torch.nn.Module) -> Optional[DynamicCache]:
        """An empty cache of ``model`` through which a prefix's keys and values can be handed to rows (a
        plain per-layer cache), or None: not with gradient checkpointing (a recomputed layer would append
        to the cache twice), not when ``sharded``, not for sliding-window or linear-attention layers."""
        if getattr(model, "is_gradient_checkpointing", False) or self.sharded:
            return None
        try:
            cache = DynamicCache(config=model.config)
        except Exception:  # noqa: BLE001 - an unusual config: recompute the prefix per row
            return None
        plain = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
        return cache if plain else None

    def sequence_logprobs(
        self, model: torch.nn.Module, batch: ExperienceBatch, start: int = 0, with_entropy: bool = False
    ) -> WindowScores:
        """Log-probs of tokens start+1.. at the batch's sampling temperature, the model's own logits and, with
        ``with_entropy``, the entropy at that temperature (from the same pass over the logits); the first
        ``start`` predictions are not computed (``window_logits``)."""
        logits = self.window_logits(model, batch.input_ids, batch.attention_mask, start)
        sampling, targets = tempered(logits, batch.temperature), batch.input_ids[:, 1 + start :]
        if with_entropy:
            logp, entropy = algos.selective_log_softmax_and_entropy(sampling, targets)
        else:
            logp, entropy = algos.selective_log_softmax(sampling, targets), None
        return WindowScores(logp, logits, entropy)

    @torch.no_grad()
    def fill_logprobs(
        self,
        experience: ExperienceBatch,
        micro_batches: list[torch.Tensor],
        policy: torch.nn.Module,
        reference: Optional[torch.nn.Module],
        recompute_old: bool,
        need_ref: bool,
        device: torch.device,
    ) -> None:
        """Recomputed behaviour log-probs of ``experience``'s sampled rows (``recompute_old``) and its
        reference log-probs (``need_ref``: under ``reference``, or ``policy`` with its adapters disabled
        when None), one no-grad pass each over ``micro_batches`` (row indices)."""
        if not need_ref and not recompute_old:
            return
        width = experience.input_ids.shape[1]
        ref = torch.zeros_like(experience.old_logprobs) if need_ref else None
        for rows in micro_batches:
            micro = experience.take(rows).to(device)
            cols = micro.input_ids.shape[1]
            if cols < 2:  # no token to score (episodes that ended before their first turn)
                continue
            start = window_start(micro)  # unscored columns keep what they hold
            if recompute_old:
                logp = self.sequence_logprobs(policy, micro, start).logp
                # Replayed rows keep the log-probs of the policy that sampled them: their ratio is the point.
                sampled = torch.tensor([b == "sampled" for b in micro.behaviour_of_rows()]).unsqueeze(1)
                kept = experience.old_logprobs[rows, 1 + start : cols]
                experience.old_logprobs[rows, 1 + start : cols] = torch.where(sampled, logp.float().cpu(), kept)
            if need_ref:
                context = policy.disable_adapter() if reference is None else contextlib.nullcontext()
                with context:
                    logp = self.sequence_logprobs(reference if reference is not None else policy, micro, start).logp
                ref[rows, 1 + start : cols] = logp.float().cpu()
        if ref is not None:
            experience.ref_logprobs = ref[:, :width]

    @torch.no_grad()
    def response_entropy(
        self, model: torch.nn.Module, batch: ExperienceBatch, micro_batch_size: int, device: torch.device
    ) -> torch.Tensor:
        """Per-token entropy [B, T-1] of ``model`` at the batch's temperature, in micro-batches, at the
        predictions of response tokens (and any other position after the first one; the leading
        predictions no response token follows are 0: ``window_logits`` skips them and encodes a group's
        shared prompt once)."""
        entropy = torch.zeros(batch.input_ids.shape[0], max(batch.input_ids.shape[1] - 1, 0))
        for rows in batch.micro_batches(micro_batch_size):
            micro = batch.take(rows).to(device)
            if micro.input_ids.shape[1] < 2:
                continue
            start = scored_window_start(micro.turn_index >= 0, micro.attention_mask)
            logits = self.window_logits(model, micro.input_ids, micro.attention_mask, start)
            values = algos.entropy_from_logits(tempered(logits, micro.temperature)).float().cpu()
            entropy[rows, start : start + values.shape[1]] = values
        return entropy

    def teacher_logits(
        self,
        teacher: torch.nn.Module,
        micro: ExperienceBatch,
        logits: torch.Tensor,
        start: int,
        contexts: Optional[Mapping[tuple[int, ...], Sequence[int]]],
        pad_token_id: int,
    ) -> tuple[torch.Tensor, int]:
        """(The teacher's logits [b, T-1-start, V] aligned with the policy's ``logits``, rows scored under a
        context of ``contexts``: the teacher's prompt token ids keyed by the student's prompt token ids).
        Where the teacher has no prediction of the same token (prompt positions) it gets the policy's own
        logits: no KL there."""
        if contexts is None:
            return self.window_logits(teacher, micro.input_ids, micro.attention_mask, start), 0
        prompt_len = prompt_lengths(micro.turn_index, micro.attention_mask)
        prompts = [contexts.get(tuple(micro.input_ids[i, : int(n)].tolist())) for i, n in enumerate(prompt_len)]
        ids, mask, offset = splice_prompts(micro.input_ids, micro.attention_mask, prompt_len, prompts, pad_token_id)
        teacher_start = max(0, int((prompt_len + offset).min()) - 1)
        window = self.window_logits(teacher, ids, mask, teacher_start)
        index, valid = aligned_predictions(prompt_len, offset, start, micro.input_ids.shape[1], teacher_start, ids.shape[1])
        gathered = window.gather(1, index.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
        return torch.where(valid.unsqueeze(-1), gathered, logits.detach()), sum(p is not None for p in prompts)
