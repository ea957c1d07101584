"""One micro-batch's loss (a pure function of its tensors) and the no-grad diagnostics beside it.

Every term is a sum over the micro-batch's tokens (or sequences) divided by ``totals``, the step's
counts summed over ranks, so the step's gradient does not depend on how it was split into micro-batches
or ranks. ``update_statistics`` turns the step's summed values into the logged ``train/`` figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from r3lightning import algos
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.forward import tempered
from r3lightning.types import ExperienceBatch

LOSS_TERMS = ("loss_rl", "loss_kl", "loss_sft", "loss_teacher_kl")


@dataclass
class LossTerms:
    """The loss terms of one micro-batch (``LOSS_TERMS`` that apply, and their sum ``loss``), with the
    per-token values [b, T-1-start] their diagnostics read: the policy loss's ratios, the KL to the
    reference and to the teacher."""

    losses: dict[str, torch.Tensor]
    policy: Optional[algos.PolicyLossOutput] = None
    kl_ref: Optional[torch.Tensor] = None
    kl_teacher: Optional[torch.Tensor] = None


def rows_where(values: list[str], wanted: str, device: torch.device) -> torch.Tensor:
    """[b, 1] bool: the rows whose entry of ``values`` (origins, behaviours) is ``wanted``."""
    return torch.tensor([v == wanted for v in values], device=device).unsqueeze(1)


def teacher_kl(
    logp: torch.Tensor, logits: torch.Tensor, teacher_logits: torch.Tensor, micro: ExperienceBatch, start: int, estimator: str
) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_teacher) [b, T-1-start] at the batch's sampling temperature: ``exact`` over the
    vocabulary, or ``sampled`` (the k3 estimate from the sampled tokens' log-probs). ``logp``, ``logits``:
    the policy's (``PrefixSharedForward.sequence_logprobs``); ``teacher_logits`` aligned with them."""
    student, teacher = tempered(logits, micro.temperature), tempered(teacher_logits, micro.temperature)
    if estimator == "exact":
        return algos.full_kl(student, teacher)
    teacher_logp = algos.selective_log_softmax(teacher, micro.input_ids[:, 1 + start :])
    return algos.kl_estimate(logp, teacher_logp, "k3")


def loss_terms(
    micro: ExperienceBatch,
    logp: torch.Tensor,
    logits: torch.Tensor,
    start: int,
    objective: AlgorithmConfig,
    totals: dict[str, float],
    sft_weight: float,
    kl_to_teacher: Optional[torch.Tensor] = None,
    teacher_kl_coef: float = 0.0,
) -> LossTerms:
    """The loss of ``micro`` [b, T] from the policy's log-probs ``logp`` [b, T-1-start] of tokens start+1..
    at the sampling temperature and its own ``logits`` [b, T-1-start, V].

    totals: ``rl_tokens``, ``rl_seqs``, ``sft_tokens``, ``sft_seqs`` of the step over all ranks.
    sft_weight: the SFT head's weight (``objective.sft_weight`` in RL steps, 1 in the warm-start).
    kl_to_teacher: per-token KL to a teacher [b, T-1-start] (``teacher_kl``), paid with
        ``teacher_kl_coef`` on the RL tokens.
    """
    cfg = objective
    mask = micro.loss_mask[:, 1 + start :]
    advantages = micro.advantages[:, 1 + start :]
    terms = LossTerms(losses={})
    zero = logp.sum() * 0.0
    if totals["rl_tokens"] > 0:
        off_policy = rows_where(micro.origins, "off_policy", logp.device)
        pinned = rows_where(micro.behaviour_of_rows(), "pinned", logp.device)
        # Pinned rows have no usable behaviour log-probs: an off-policy refinement was sampled in another
        # context (with its critique; its rows take the shaping loss below), a replayed sample treated as
        # on-policy is scored as if drawn now. Their ratio is 1; an inf there would still turn gradients to NaN.
        old_logprobs = torch.where(pinned, logp.detach(), micro.old_logprobs[:, 1 + start :])
        terms.policy = algos.policy_loss(
            logp, old_logprobs, advantages, mask, cfg.policy_loss, cfg.clip_eps_low, cfg.clip_eps_high
        )
        per_token = terms.policy.per_token
        if off_policy.any():
            shaped = algos.shaped_off_policy_loss(logp, advantages, cfg.off_policy_gamma)
            per_token = torch.where(off_policy, shaped, per_token)
        terms.losses["loss_rl"] = algos.aggregate(per_token, mask, cfg.aggregation, totals["rl_tokens"], totals["rl_seqs"])
        if cfg.kl_coef > 0 and micro.ref_logprobs is not None:
            terms.kl_ref = algos.kl_estimate(logp, micro.ref_logprobs[:, 1 + start :], cfg.kl_estimator)
            terms.losses["loss_kl"] = cfg.kl_coef * algos.aggregate(
                terms.kl_ref, mask, "token_mean", totals["rl_tokens"], totals["rl_seqs"]
            )
        if kl_to_teacher is not None:
            terms.kl_teacher = kl_to_teacher
            terms.losses["loss_teacher_kl"] = teacher_kl_coef * algos.aggregate(
                kl_to_teacher, mask, "token_mean", totals["rl_tokens"], totals["rl_seqs"]
            )
    if totals["sft_tokens"] > 0:
        # The SFT head fits the model's own distribution, not the tempered sampling one; taken from the
        # untempered logits, the warm-start is bit-for-bit the same whatever the sampling temperature.
        sft_logp = logp
        if micro.temperature != 1.0:
            sft_logp = algos.selective_log_softmax(logits, micro.input_ids[:, 1 + start :])
        nll = algos.aggregate(
            algos.sft_nll(sft_logp), micro.sft_mask[:, 1 + start :], cfg.sft_aggregation, totals["sft_tokens"], totals["sft_seqs"]
        )
        terms.losses["loss_sft"] = sft_weight * nll
    terms.losses["loss"] = sum((terms.losses[k] for k in LOSS_TERMS if k in terms.losses), zero)
    return terms


@torch.no_grad()
def loss_diagnostics(
    micro: ExperienceBatch,
    logp: torch.Tensor,
    entropy: Optional[torch.Tensor],
    start: int,
    terms: LossTerms,
    teacher_context_rows: int = 0,
) -> dict[str, torch.Tensor]:
    """Sums over ``micro``'s loss tokens that ``update_statistics`` turns into figures: the policy ratio on
    the tokens that have one (``ratio_*``, ``clip_count``), log π_θ - log π_behaviour per origin
    (``logratio_*``), the KL to the reference and to the teacher (with the rows the teacher scored under a
    context of its own, ``teacher_context_rows``) and, given ``entropy`` [b, T-1-start] (the policy's at the
    sampling temperature), its sums on every RL and SFT token (``entropy_*``) and on the RL tokens alone
    (``entropy_rl_*``: the policy's entropy on its own rollouts, without the SFT rows)."""
    mask = micro.loss_mask[:, 1 + start :]
    zero = logp.sum() * 0.0
    out: dict[str, torch.Tensor] = {}
    if terms.policy is not None:
        if terms.policy.ratio is not None:
            m = mask.bool() & ~rows_where(micro.behaviour_of_rows(), "pinned", logp.device)
            out["ratio_sum"] = (terms.policy.ratio * m).sum()
            out["ratio_max"] = (terms.policy.ratio * m).max() if m.any() else zero
            out["clip_count"] = (terms.policy.clipped & m).sum().float()
            out["ratio_count"] = m.sum().float()
        # ~0 for fresh samples (engine and trainer agree), the context-distillation gap for distilled rows
        # (sampled with guidance, scored without).
        logratio = logp - micro.old_logprobs[:, 1 + start :]
        scored = mask.bool() & torch.isfinite(logratio)
        logratio = torch.where(scored, logratio, 0.0)
        for origin in sorted(set(micro.origins)):
            rows = torch.tensor([o == origin for o in micro.origins], device=logp.device)
            count = scored[rows].sum()
            if count > 0:
                out[f"logratio_sum/{origin}"] = logratio[rows].sum()
                out[f"logratio_count/{origin}"] = count.float()
    if terms.kl_ref is not None:
        out["kl_ref_sum"] = (terms.kl_ref * mask).sum()
    if terms.kl_teacher is not None:
        out["teacher_context_rows"] = zero + teacher_context_rows
        out["teacher_rows"] = zero + len(micro)
        out["kl_teacher_sum"] = (terms.kl_teacher * mask).sum()
    if entropy is not None:
        scored = torch.maximum(mask, micro.sft_mask[:, 1 + start :])
        out["entropy_sum"] = (entropy * scored).sum()
        out["entropy_count"] = scored.sum()
        out["entropy_rl_sum"] = (entropy * mask).sum()
        out["entropy_rl_count"] = mask.sum()
    return out


def update_statistics(sums: dict[str, float], rl_tokens: float) -> dict[str, float]:
    """The step's figures of its loss terms and diagnostics from their values summed over its micro-batches
    (``ratio_max``: their maximum); ``rl_tokens``: this rank's RL loss tokens."""
    stats: dict[str, float] = {}
    for name in ("loss_rl", "loss_sft", "loss_kl"):
        if name in sums:
            stats[f"train/{name}"] = sums[name]
    if "entropy_count" in sums:
        stats["train/entropy"] = sums["entropy_sum"] / max(sums["entropy_count"], 1.0)
    if sums.get("entropy_rl_count", 0.0) > 0:
        stats["train/entropy_rl"] = sums["entropy_rl_sum"] / sums["entropy_rl_count"]
    if "kl_ref_sum" in sums:
        stats["train/kl_ref"] = sums["kl_ref_sum"] / max(rl_tokens, 1.0)
    if "kl_teacher_sum" in sums:
        stats["distill/kl_teacher"] = sums["kl_teacher_sum"] / max(rl_tokens, 1.0)
        stats["train/loss_teacher_kl"] = sums["loss_teacher_kl"]
        stats["distill/teacher_context_rate"] = sums["teacher_context_rows"] / max(sums["teacher_rows"], 1.0)
    for name in sums:
        if name.startswith("logratio_sum/"):
            origin = name.split("/", 1)[1]
            stats[f"train/logratio_{origin}"] = sums[name] / sums[f"logratio_count/{origin}"]
    if "ratio_sum" in sums:
        # Over the tokens that have a ratio: off-policy refinements have none.
        stats["train/ratio_mean"] = sums["ratio_sum"] / max(sums["ratio_count"], 1.0)
        stats["train/ratio_max"] = sums["ratio_max"]
        stats["train/clip_frac"] = sums["clip_count"] / max(sums["ratio_count"], 1.0)
    return stats
