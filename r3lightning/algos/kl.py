"""KL estimators between the policy and a frozen reference or teacher."""

from __future__ import annotations

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled-token log-probs, shape [B, T].

    logprobs, ref_logprobs: [B, T] log-probs of the sampled tokens under π and π_ref.
    With log-ratio d = log π - log π_ref:
    k1 = d (unbiased, high variance, can be negative);
    k2 = d² / 2 (biased, low variance; its gradient is the reverse-KL gradient);
    k3 = exp(-d) + d - 1 (unbiased, always >= 0; Schulman's estimator, used by GRPO).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(π_student ‖ π_teacher) over the vocabulary at each position, shape [B, T].

    student_logits, teacher_logits: [B, T, V]. Used by ReflectRL's reflective-to-direct distillation,
    where the full distributions are available from both forward passes.
    """
    rows = []
    for s_row, t_row in zip(student_logits, teacher_logits):
        log_s = torch.log_softmax(s_row.float(), dim=-1)
        log_t = torch.log_softmax(t_row.float(), dim=-1)
        rows.append((log_s.exp() * (log_s - log_t)).sum(dim=-1))
    return torch.stack(rows)
