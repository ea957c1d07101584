"""R³ structural-entropy ranking of failed samples (Jiang et al., arXiv 2601.19620; our reading, docs/r3.md).

A group whose samples all fail gives GRPO no gradient: every reward is the same. R³ breaks the tie by
ranking the failed samples on the *shape* of their token-entropy sequence and giving the better-shaped
ones a small bonus. This module is our reading of the paper; its code is not released.

Structural entropy. ``H_t`` is the policy's entropy at response token ``t`` (``entropy_from_logits``
on the loss tokens). A response's structure is scored on two scales:

- local exploration ``L = mean of the top min(top_k, n) entropies`` of its ``n`` tokens: does the
  response explore at a few forking tokens. A fixed count, not a share of ``n``: with a share, the
  count steps up with length (1 token up to 5, 2 from 6 at 20%) and a short answer that stops right
  after its one forking token outscores every longer one. At a constant entropy profile ``L`` does not
  move with length.
- global stability ``G = -std_pop(w_1, ..., w_J)``, where ``w_j`` is the mean entropy of the ``j``-th
  window of ``window`` consecutive response tokens (the last window may be shorter): does uncertainty
  stay level over the response. ``G`` is *undefined* (NaN) with fewer than two windows, not 0: 0 is
  its best value, and giving it to every response of one window made short answers the most "stable".

``S = weight_local · L + weight_global · G``, where an undefined ``G`` takes the mean of the defined
``G`` of the ranked samples in its group (neither best nor worst; 0 when none has one).

Ranking. Within each group, the ranked samples (failed ones that generated at least one token) are
ordered by ``(tier, S)``: ``tier`` 1 for truncated or well-formed failures (a wrong answer in the
right format: the seed's "truncated or failed samples"), 0 for failures whose answer could not be read.
Ties share the mean of their ranks. Rank ``ρ ∈ [0, n_ranked - 1]`` gives the bonus

    b = delta · (ρ / (n_ranked - 1) - 1/2)       (0 for a lone ranked sample)

which is centred (it sums to 0 over the group's ranked samples) and spans ``delta``. The bonus is added
to the *advantage* after the group estimator (``add_failure_bonus``), not to the reward: GRPO's z-score
would otherwise stretch any reward spread of an all-fail group to ±1.4, whatever ``delta``, so that the
best-ranked failure outweighed a success of a half-solved group. A failure's advantage is also capped
at the lowest success advantage of its group, so no failure ever outranks a success.

What the paper does not pin down, and we had to choose: ``top_k``, ``window`` and the weights (no
defaults here: a recipe states them); population std; ranks rather than raw scores (the bonus does not
depend on the scale of entropy); the tiers; adding the bonus to the advantage.
"""

from __future__ import annotations

import torch


def _check_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor) -> None:
    if entropy.dim() != 2 or entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must both be [B, T]")


def _float_dtype(values: torch.Tensor) -> torch.dtype:
    return values.dtype if values.is_floating_point() else torch.float32


def local_exploration_score(entropy: torch.Tensor, mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mean of each row's top ``min(top_k, n)`` masked entropies, shape [B].

    entropy: [B, T] per-token entropy; mask: [B, T], nonzero on the response tokens to score.
    Rows with no masked token are undefined (NaN).
    """
    _check_entropy_mask(entropy, mask)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    keep = mask != 0
    n = keep.sum(dim=1)
    k = n.clamp(max=top_k)
    # Unmasked tokens sort last, so the first k of a row are its top-k masked ones.
    ranked = entropy.double().masked_fill(~keep, float("-inf")).sort(dim=1, descending=True).values
    position = torch.arange(entropy.shape[1], device=entropy.device)
    top = position[None, :] < k[:, None]
    mean = torch.where(top, ranked, torch.zeros_like(ranked)).sum(dim=1) / k.clamp(min=1)
    return torch.where(n > 0, mean, torch.full_like(mean, float("nan"))).to(_float_dtype(entropy))


def global_stability_score(entropy: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    """Negative population std of each row's windowed mean entropy, shape [B].

    entropy: [B, T]; mask: [B, T]. A row's masked tokens, in order and skipping unmasked ones, are cut
    into consecutive windows of ``window`` tokens (the last may be shorter); each window's mean is one
    sample of the std. Rows with fewer than two windows are undefined (NaN).
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
    return torch.where(num_windows >= 2, -std, torch.full_like(std, float("nan"))).to(_float_dtype(entropy))


def structural_entropy_score(
    local: torch.Tensor,
    stability: torch.Tensor,
    ranked: torch.Tensor,
    group_index: torch.Tensor,
    weight_local: float,
    weight_global: float,
) -> torch.Tensor:
    """``weight_local · local + weight_global · stability`` of the ranked rows, shape [N]; NaN elsewhere.

    local, stability: [N] (``local_exploration_score``, ``global_stability_score``; NaN = undefined);
    ranked: [N] bool; group_index: [N] long. An undefined stability takes the mean of the defined
    stabilities of the ranked rows of its group (0 when there is none), so a one-window response is
    scored as neither the most nor the least stable.
    """
    if not (local.shape == stability.shape == ranked.shape == group_index.shape) or local.dim() != 1:
        raise ValueError(
            f"local {tuple(local.shape)}, stability {tuple(stability.shape)}, ranked {tuple(ranked.shape)} and "
            f"group_index {tuple(group_index.shape)} must all be [N]"
        )
    ranked = ranked.bool()
    if torch.isnan(local[ranked]).any():
        raise ValueError("ranked rows must have a local score (at least one response token)")
    defined = ranked & ~torch.isnan(stability)
    same_group = group_index[:, None] == group_index[None, :]
    donors = same_group & defined[None, :]
    total = torch.where(donors, torch.nan_to_num(stability.double())[None, :], torch.zeros((), dtype=torch.float64)).sum(dim=1)
    filled = total / donors.sum(dim=1).clamp(min=1)
    stability = torch.where(defined, stability.double(), filled)
    score = weight_local * local.double() + weight_global * stability
    return torch.where(ranked, score, torch.full_like(score, float("nan"))).to(_float_dtype(local))


def ranking_bonus(
    scores: torch.Tensor, tier: torch.Tensor, ranked: torch.Tensor, group_index: torch.Tensor, delta: float
) -> torch.Tensor:
    """Centred rank bonus in ``[-delta/2, delta/2]`` of the ranked rows, 0 elsewhere, shape [N].

    scores: [N] structural-entropy scores (finite on ranked rows); tier: [N] long, compared before the
    score (higher ranks higher); ranked: [N] bool, the rows to rank (failed, with response tokens);
    group_index: [N] long, rows ranked together. Ties share the mean of their ranks, so the bonus does
    not depend on row order and sums to 0 over each group's ranked rows.
    """
    if not (scores.shape == tier.shape == ranked.shape == group_index.shape) or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)}, tier {tuple(tier.shape)}, ranked {tuple(ranked.shape)} and "
            f"group_index {tuple(group_index.shape)} must all be [N]"
        )
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    ranked = ranked.bool()
    if not torch.isfinite(scores[ranked]).all():
        raise ValueError("scores of ranked samples must be finite")
    s = torch.nan_to_num(scores.double())
    t = tier.long()
    # Pairwise comparisons among ranked rows of the same group: O(N²) memory, fine for the few
    # thousand sequences of one training step.
    peers = (group_index[:, None] == group_index[None, :]) & ranked[:, None] & ranked[None, :]
    lower = (t[None, :] < t[:, None]) | ((t[None, :] == t[:, None]) & (s[None, :] < s[:, None]))
    level = (t[None, :] == t[:, None]) & (s[None, :] == s[:, None])
    below = (peers & lower).sum(dim=1).double()
    tied = (peers & level).sum(dim=1).double()
    rank = below + (tied - 1) / 2
    n_ranked = peers.sum(dim=1).double()
    bonus = delta * (rank / (n_ranked - 1).clamp(min=1) - 0.5)
    bonus = torch.where(ranked & (n_ranked > 1), bonus, torch.zeros_like(bonus))
    return bonus.to(_float_dtype(scores))


def add_failure_bonus(
    advantages: torch.Tensor, bonus: torch.Tensor, success: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N] with ``bonus`` added to the failed rows, capped rows [N] bool).

    advantages, bonus: [N]; success: [N] bool; group_index: [N] long. A failed row's advantage after the
    bonus is capped at the lowest success advantage of its group (groups without a success have no
    cap), so no failure ever outranks a success; ``capped`` marks where the cap acted.
    """
    if not (advantages.shape == bonus.shape == success.shape == group_index.shape) or advantages.dim() != 1:
        raise ValueError(
            f"advantages {tuple(advantages.shape)}, bonus {tuple(bonus.shape)}, success {tuple(success.shape)} and "
            f"group_index {tuple(group_index.shape)} must all be [N]"
        )
    success = success.bool()
    same_group = group_index[:, None] == group_index[None, :]
    succ_adv = torch.where(same_group & success[None, :], advantages[None, :], torch.full_like(advantages, float("inf"))[None, :])
    ceiling = succ_adv.min(dim=1).values
    raised = advantages + torch.where(success, torch.zeros_like(bonus), bonus)
    capped = ~success & (raised > ceiling)
    return torch.where(capped, ceiling, raised), capped
