"""Validation figures: what papers report from the greedy and sampled episodes of held-out tasks.

One validation batch of T tasks gives T greedy episodes and ``n = data.val_samples`` sampled episodes
per task. ``validation_figures`` turns them into task-averaged figures, logged as ``val/<name>``:

- ``success_rate_greedy`` (greedy pass@1), ``response_len_greedy``, ``truncated_rate_greedy``;
- ``success_rate``, ``reward_mean``, ``response_len``, ``truncated_rate``: over the sampled episodes
  (with n = 1, one sampled episode per task, as before ``val_samples`` existed);
- ``pass@k`` for k = 1, 2, 4, ... up to n and k = n (the unbiased estimator, ``algos.pass_at_k``);
- ``mean@n``: the expected fraction of correct samples among k drawn, c / n for every k, so only
  one mean@ figure is logged (it equals ``success_rate`` and ``pass@1``).

Every figure is a mean over tasks; averaging batches weighted by their number of tasks gives the
mean over the whole validation set.
"""

from __future__ import annotations

from r3lightning.algos.pass_at_k import summarize
from r3lightning.types import Trajectory


def pass_ks(samples: int) -> list[int]:
    """The k of the ``pass@k`` figures for ``samples`` per task: 1, 2, 4, ... up to it, and itself."""
    if samples < 1:
        raise ValueError(f"data.val_samples must be >= 1, got {samples}")
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples]


def validation_names(samples: int) -> list[str]:
    """Names (without ``val/``) of the figures ``validation_figures`` returns for ``samples`` per task."""
    return [
        "success_rate_greedy",
        "response_len_greedy",
        "truncated_rate_greedy",
        "success_rate",
        "reward_mean",
        "response_len",
        "truncated_rate",
        *(f"pass@{k}" for k in pass_ks(samples)),
        f"mean@{samples}",
    ]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def validation_figures(greedy: list[Trajectory], sampled: list[Trajectory], samples: int) -> dict[str, float]:
    """Task-averaged figures of one validation batch (names as in ``validation_names``).

    greedy: one episode per task, [T]; sampled: ``samples`` episodes per task, task-major
    (task 0's samples, then task 1's...), [T * samples]. A sample is correct when ``success``.
    """
    tasks = len(greedy)
    if tasks == 0 or len(sampled) != tasks * samples:
        raise ValueError(f"validation: {len(sampled)} sampled episodes for {tasks} tasks x {samples} samples")
    correct = [[t.success for t in sampled[i * samples : (i + 1) * samples]] for i in range(tasks)]
    figures = {
        "success_rate_greedy": _mean([float(t.success) for t in greedy]),
        "response_len_greedy": _mean([float(t.num_response_tokens) for t in greedy]),
        "truncated_rate_greedy": _mean([float(t.truncated) for t in greedy]),
        "success_rate": _mean([float(t.success) for t in sampled]),
        "reward_mean": _mean([t.reward for t in sampled]),
        "response_len": _mean([float(t.num_response_tokens) for t in sampled]),
        "truncated_rate": _mean([float(t.truncated) for t in sampled]),
    }
    figures.update(summarize(correct, pass_ks(samples)))
    return figures
