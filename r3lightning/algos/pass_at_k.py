"""pass@k and mean@k: how often a policy solves a task within k samples.

With n samples per task of which c are correct, the unbiased estimator of pass@k (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k),

the probability that k samples drawn without replacement from the n include a correct one. The
binomial coefficients overflow for realistic n, so it is computed as the product

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i),

which is 0 (pass@k = 1) when n - c < k: every draw of k samples then contains a correct one.
mean@k, the expected fraction of correct samples among k drawn, is c / n whatever k is.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Union

import torch

Counts = Union[torch.Tensor, Sequence[int]]


def _counts(num_samples: Counts, num_correct: Counts) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and return (n [T], c [T]) as int64 tensors."""
    n = torch.as_tensor(num_samples, dtype=torch.long)
    c = torch.as_tensor(num_correct, dtype=torch.long)
    if n.dim() != 1 or n.shape != c.shape:
        raise ValueError(f"num_samples {tuple(n.shape)} and num_correct {tuple(c.shape)} must both be [T]")
    if bool((n < 1).any()):
        raise ValueError(f"num_samples must be >= 1 for every task, got {n.tolist()}")
    if bool((c < 0).any()) or bool((c > n).any()):
        raise ValueError(f"num_correct must be in [0, num_samples] for every task, got {c.tolist()} of {n.tolist()}")
    return n, c


def _check_k(k: int, n: torch.Tensor) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if bool((n < k).any()):
        raise ValueError(f"k={k} exceeds num_samples for some task (smallest num_samples: {int(n.min())})")


def pass_at_k(num_samples: Counts, num_correct: Counts, k: int) -> torch.Tensor:
    """Unbiased pass@k per task, [T] float64.

    num_samples: [T] samples drawn per task (n); num_correct: [T] correct ones among them (c);
    k: 1 <= k <= n for every task.
    """
    n, c = _counts(num_samples, num_correct)
    _check_k(k, n)
    if n.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    # One row per task over i = 1..max(n); only i in (n - c, n] enters the product. Those i exceed
    # k whenever n - c >= k, so every factor 1 - k/i is positive and the product is taken as a sum
    # of logs; tasks with n - c < k have a factor of 0 and pass@k = 1.
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64).unsqueeze(0)
    in_product = (i > (n - c).unsqueeze(1)) & (i <= n.unsqueeze(1))
    log_terms = torch.log1p(-k / torch.where(in_product, i, torch.inf))
    all_fail = torch.exp(log_terms.sum(dim=1))
    return torch.where(n - c < k, torch.ones_like(all_fail), 1.0 - all_fail)


def mean_at_k(num_samples: Counts, num_correct: Counts, k: int) -> torch.Tensor:
    """mean@k per task, [T] float64: the expected fraction of correct samples among k drawn without
    replacement from the n, which is c / n for every k (validated like :func:`pass_at_k`)."""
    n, c = _counts(num_samples, num_correct)
    _check_k(k, n)
    return c.double() / n.double()


def summarize(correct: list[list[bool]], ks: Iterable[int]) -> dict[str, float]:
    """Task-averaged ``pass@k`` for each k in ``ks`` up to n, and ``mean@n``.

    correct: one list per task of the n samples' outcomes (the same n for every task). Values of k
    above n are left out, so one ``ks`` (say 1, 4, 16) serves evaluations with any n.
    Returns e.g. ``{"pass@1": 0.4, "pass@4": 0.7, "mean@8": 0.4}``.
    """
    if not correct:
        raise ValueError("correct: no tasks")
    sizes = {len(row) for row in correct}
    if len(sizes) != 1:
        raise ValueError(f"correct: every task needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop()
    num_samples = [n] * len(correct)
    num_correct = [sum(bool(x) for x in row) for row in correct]
    out = {
        f"pass@{k}": float(pass_at_k(num_samples, num_correct, k).mean()) for k in sorted(set(ks)) if k <= n
    }
    out[f"mean@{n}"] = float(mean_at_k(num_samples, num_correct, n).mean())
    return out
