"""R³ structural-entropy ranking reward for failed or truncated samples (Jiang et al., arXiv 2601.19620).

A group whose samples all fail gives GRPO no gradient: every reward is the same. R³ breaks the tie by
ranking the failed samples on the *shape* of their token-entropy sequence and handing out small,
ordered rewards that stay below any success. This module is our reading of the paper; its code is not
released.

Structural entropy. ``H_t`` is the policy's entropy at response token ``t`` (``entropy_from_logits``
on the loss tokens). A response's structure is scored on two scales:

- local exploration ``L = mean of the top ceil(q·n) entropies`` (at least one token) of its ``n``
  tokens: does the response explore at a few forking tokens, rather than follow one path throughout;
- global stability ``G = -std_pop(w_1, ..., w_J)``, where ``w_j`` is the mean entropy of the ``j``-th
  window of ``window`` consecutive response tokens (the last window may be shorter; every window
  counts once): does uncertainty stay level over the whole response, rather than drift or collapse
  into rambling. ``G = 0`` with fewer than two windows.

``S = weight_local · L + weight_global · G``. Within each group, the failed samples are ranked by ``S``
(ties share the mean of their ranks) and rank ``ρ ∈ [0, n_fail - 1]`` maps linearly to

    r = r_fail + delta · ρ / (n_fail - 1)        (r_fail + delta / 2 for a lone failed sample)

so the best-structured failure gets ``r_fail + delta`` and the worst ``r_fail``. Successful samples keep
their reward. ``r_fail + delta < success_margin`` (the smallest reward a success can have) is
required, so no failure ever reaches a success. ``ranking_reward(...) - rewards`` is the bonus the
caller logs as ``reward/ranking_bonus_mean``.

Knobs: ``top_q`` (fraction of tokens in the local score), ``window`` (tokens per window),
``weight_local`` / ``weight_global``, ``r_fail``, ``delta``, ``success_margin``.

What the paper does not pin down, and we had to choose:
- the exact ``q``, ``window`` and weights (no defaults here: a recipe must state them);
- whether ``top-q`` rounds up or down (we round up, so a short response still has one token);
- population vs sample std, and whether the short last window counts fully (population; it does);
- whether truncated samples count as failures (the caller decides and passes ``failed``);
- ranks rather than raw scores: we map ranks, so the reward spread does not depend on the scale of
  entropy, and equal scores get equal rewards.
"""

from __future__ import annotations

import torch


def _check_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor) -> None:
    if entropy.dim() != 2 or entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must both be [B, T]")


def _float_dtype(values: torch.Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.float32


def local_exploration_score(entropy: torch.Tensor, mask: torch.Tensor, top_q: float) -> torch.Tensor:
    """Mean of each row's top ``ceil(top_q · n)`` masked entropies (at least one), shape [B].

    entropy: [B, T] per-token entropy; mask: [B, T], nonzero on the response tokens to score.
    Rows with no masked token score 0.
    """
    _check_entropy_mask(entropy, mask)
    if not 0.0 < top_q <= 1.0:
        raise ValueError(f"top_q must be in (0, 1], got {top_q}")
    keep = mask != 0
    n = keep.sum(dim=1).double()
    # The 1e-9 keeps float error from rounding an exact product up (0.1 * 30 = 3.0000000000000004).
    k = torch.ceil(top_q * n - 1e-9).clamp(min=1)
    # Unmasked tokens sort last, so the first k of a row with n >= k tokens are its top-k masked ones.
    ranked = entropy.double().masked_fill(~keep, float("-inf")).sort(dim=1, descending=True).values
    position = torch.arange(entropy.shape[1], device=entropy.device)
    top = (position[None, :] < k[:, None]) & (position[None, :] < n[:, None])
    mean = torch.where(top, ranked, torch.zeros_like(ranked)).sum(dim=1) / k
    return torch.where(n > 0, mean, torch.zeros_like(mean)).to(_float_dtype(entropy))


def global_stability_score(entropy: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    """Negative population std of each row's windowed mean entropy, shape [B].

    entropy: [B, T]; mask: [B, T]. A row's masked tokens, in order and skipping unmasked ones, are cut
    into consecutive windows of ``window`` tokens (the last may be shorter); each window's mean is one
    sample of the std. Rows with fewer than two windows score 0.
    """
    _check_entropy_mask(entropy, mask)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    keep = mask != 0
    rows, length = entropy.shape
    # Window of each masked token = its rank among the row's masked tokens // window; unmasked tokens
    # go to an extra dump column that is dropped.
    num_slots = -(-length // window)
    slot = torch.div(keep.long().cumsum(dim=1) - 1, window, rounding_mode="floor")
    slot = torch.where(keep, slot, torch.full_like(slot, num_slots))
    values = torch.where(keep, entropy.double(), torch.zeros_like(entropy, dtype=torch.float64))
    sums = torch.zeros(rows, num_slots + 1, dtype=torch.float64, device=entropy.device).scatter_add_(1, slot, values)
    counts = torch.zeros_like(sums).scatter_add_(1, slot, keep.double())
    sums, counts = sums[:, :num_slots], counts[:, :num_slots]
    present = counts > 0
    means = sums / counts.clamp(min=1)
    num_windows = present.sum(dim=1)
    centre = means.sum(dim=1) / num_windows.clamp(min=1)
    spread = torch.where(present, (means - centre[:, None]) ** 2, torch.zeros_like(means)).sum(dim=1)
    std = (spread / num_windows.clamp(min=1)).sqrt()
    return torch.where(num_windows >= 2, -std, torch.zeros_like(std)).to(_float_dtype(entropy))


def structural_entropy_score(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    top_q: float,
    window: int,
    weight_local: float,
    weight_global: float,
) -> torch.Tensor:
    """``weight_local · local_exploration_score + weight_global · global_stability_score``, shape [B].

    entropy: [B, T] per-token entropy; mask: [B, T], nonzero on the response tokens to score.
    """
    local = local_exploration_score(entropy, mask, top_q)
    stability = global_stability_score(entropy, mask, window)
    return weight_local * local + weight_global * stability


def ranking_reward(
    scores: torch.Tensor,
    rewards: torch.Tensor,
    failed: torch.Tensor,
    group_index: torch.Tensor,
    r_fail: float,
    delta: float,
    success_margin: float,
) -> torch.Tensor:
    """Rewards with every failed sample replaced by its ranked reward in [r_fail, r_fail + delta], shape [N].

    scores: [N] structural-entropy scores; rewards: [N]; failed: [N] bool, the samples to re-reward
    (failed, and truncated if the caller counts those); group_index: [N] long, samples ranked together.
    success_margin: the smallest reward a successful sample can have; ``r_fail + delta`` must stay
    below it. Ties share the mean of their ranks, so the result does not depend on sample order.
    """
    if not (scores.shape == rewards.shape == failed.shape == group_index.shape) or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)}, rewards {tuple(rewards.shape)}, failed {tuple(failed.shape)} "
            f"and group_index {tuple(group_index.shape)} must all be [N]"
        )
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    if r_fail + delta >= success_margin:
        raise ValueError(
            f"delta={delta} lets a failure reach a success: r_fail + delta = {r_fail + delta} must be "
            f"< success_margin = {success_margin}"
        )
    failed = failed.bool()
    if not torch.isfinite(scores[failed]).all():
        raise ValueError("scores of failed samples must be finite")
    s = scores.double()
    # Pairwise comparisons among failed samples of the same group: O(N²) memory, fine for the few
    # thousand sequences of one training step.
    peers = (group_index[:, None] == group_index[None, :]) & failed[:, None] & failed[None, :]
    below = (peers & (s[None, :] < s[:, None])).sum(dim=1).double()
    tied = (peers & (s[None, :] == s[:, None])).sum(dim=1).double()
    rank = below + (tied - 1) / 2
    n_fail = peers.sum(dim=1).double()
    fraction = torch.where(n_fail > 1, rank / (n_fail - 1).clamp(min=1), torch.full_like(rank, 0.5))
    ranked = r_fail + delta * fraction
    out = torch.where(failed, ranked, rewards.double())
    return out.to(_float_dtype(rewards))
