"""Premise gates: the figures that say whether a method's precondition holds before its result is read.

- ReflectRL's context-distillation teacher is worth distilling only if it answers better with a golden
  negative (GNT) in its prompt than without one: ``paired_success_sums`` and ``context_gain``, on the
  same questions, so the gain is paired.
- R³L's pivotal credit is justified by a lower-variance policy gradient: ``gradient_variance`` estimates
  the variance of a step's gradient from the gradients of its micro-batches.
"""

from __future__ import annotations

import math

import torch


def paired_success_sums(with_context: torch.Tensor, without_context: torch.Tensor) -> torch.Tensor:
    """Sums over questions of a paired success comparison, to be added over ranks before ``context_gain``.

    with_context, without_context: [n] success (0/1 or a reward in [0, 1]) of the same n questions,
    answered with and without the extra context. Returns a float64 tensor [4]:
    (n, Σ with, Σ without, Σ (with − without)²).
    """
    if with_context.shape != without_context.shape or with_context.dim() != 1:
        raise ValueError(f"paired_success_sums: two [n] tensors of one shape, got {tuple(with_context.shape)} and {tuple(without_context.shape)}")
    a, b = with_context.double(), without_context.double()
    return torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64), a.sum(), b.sum(), (a - b).pow(2).sum()])


def context_gain(sums: torch.Tensor) -> dict[str, float]:
    """The paired comparison of ``paired_success_sums`` (summed over ranks): [4] -> figures.

    ``with``: mean success with the context; ``without``: without it; ``gain``: with − without (the mean
    per-question difference d); ``gain_se``: its standard error, sd(d) / √n with the n − 1 sample
    standard deviation (nan below 2 questions); ``questions``: n. With n = 0 every rate is nan.
    """
    n, total_with, total_without, squares = (float(x) for x in sums)
    if n <= 0:
        nan = float("nan")
        return {"with": nan, "without": nan, "gain": nan, "gain_se": nan, "questions": 0.0}
    gain = (total_with - total_without) / n
    if n > 1:
        variance = max(squares - n * gain * gain, 0.0) / (n - 1)
        se = math.sqrt(variance / n)
    else:
        se = float("nan")
    return {"with": total_with / n, "without": total_without / n, "gain": gain, "gain_se": se, "questions": n}


def gradient_variance(chunk_sq_norms: torch.Tensor, total_sq_norm: float) -> tuple[float, float]:
    """Variance of a step's gradient G = Σ_m g_m estimated from its M micro-batch contributions g_m.

    Each M·g_m is an estimate of G from one chunk of the step's rows; their sample covariance over the M
    chunks, divided by M, is the covariance of G as the mean of those estimates. Its trace is
    ``(M Σ_m ‖g_m‖² − ‖G‖²) / (M − 1)`` (treating the chunks as exchangeable; chunks of unequal size
    make this an approximation).

    chunk_sq_norms: [M] ‖g_m‖² of the micro-batches that hold loss tokens; total_sq_norm: ‖G‖² of their
    sum. Returns (trace of Var[G], that trace / ‖G‖²: the noise-to-signal ratio, scale free); (nan, nan)
    below two chunks, and the ratio is nan when G = 0.
    """
    m = chunk_sq_norms.numel()
    if m < 2:
        return float("nan"), float("nan")
    variance = max((m * float(chunk_sq_norms.double().sum()) - total_sq_norm) / (m - 1), 0.0)
    relative = variance / total_sq_norm if total_sq_norm > 0 else float("nan")
    return variance, relative
