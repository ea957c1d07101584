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

``S = weight_local · L + weight_global · G``.

Pairs, on the tokens both have. Two failures of lengths ``n_i`` and ``n_j`` are compared on their first
``m = min(n_i, n_j)`` tokens (``pairwise_entropy_order``), on the scales those m tokens have: ``L`` from
``m >= top_k``, ``G`` from two windows. Scoring each response whole let length act through the scales
themselves: on prefixes of one falling entropy profile the shorter answer always won (its windows
spread less), on a rising one the longer (its top-k grew), and a 1-token answer was scored on its one
entropy and could rank first. On common prefixes, responses cut from one profile tie at any length, a
1-token answer ties with everyone (it has no top-2 and no two windows), and a 3-token answer is not
placed by the other answers' stability. Length has **no lever** in our reading: the paper reports
fewer tokens as an outcome, not a length preference in the score (``order: length`` is that
preference, as a control).

Ranking. Within each group, the ranked samples (failed ones that generated at least one token) are
ordered pairwise by tier, then by the pairwise order: ``tier`` 1 for failures whose answer the
environment could read (a wrong answer in the right format), 0 for those it could not (a malformed or
rejected action); truncation does not change the tier, so a ramble cut at the length cap is not lifted
above an empty answer. A sample's rank ``ρ`` is its wins plus half its ties over its ``n_ranked - 1``
peers, and gives the bonus

    b = delta · (ρ / (n_ranked - 1) - 1/2)       (0 for a lone ranked sample)

which is centred (it sums to 0 over the group's ranked samples) and spans ``delta``. The bonus is added
to the *advantage* after the group estimator (``add_failure_bonus``), not to the reward: GRPO's z-score
would otherwise stretch any reward spread of an all-fail group to ±1.4, whatever ``delta``, so that the
best-ranked failure outweighed a success of a half-solved group. A failure's advantage is also capped
at the lowest success advantage of the whole step (every group), so no failure out-advantages a
success under any estimator.

What the paper does not pin down, and we had to choose: ``top_k``, ``window`` and the weights (no
defaults here: a recipe states them); population std; ranks rather than raw scores (the bonus does not
depend on the scale of entropy); comparing on common prefixes; the tiers; adding the bonus to the
advantage.
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


def keep_first(mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``mask`` [B, T] with only the first ``count[b]`` nonzero positions of each row kept (bool [B, T]).

    count: [B] long. The response of row ``b`` cut to its first ``count[b]`` tokens.
    """
    keep = mask != 0
    return keep & (keep.long().cumsum(dim=1) <= count[:, None])


def pairwise_entropy_order(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    peers: torch.Tensor,
    top_k: int,
    window: int,
    weight_local: float,
    weight_global: float,
    chunk_elements: int = 1 << 22,
) -> torch.Tensor:
    """Who wins each pair of peers on the structural-entropy score, shape [N, N] in {-1, 0, +1}.

    entropy, mask: [N, T] per-token entropy and the response tokens; peers: [N, N] bool, the pairs to
    compare (symmetric, diagonal ignored). ``order[i, j] = sign(S_i - S_j)``, where both scores are
    taken over the **first m = min(n_i, n_j) tokens** of each response: a pair is compared on the tokens
    both have. ``S = weight_local · L + weight_global · G`` over the scales those m tokens have: ``L``
    when ``m >= top_k``, ``G`` when m makes two windows (``m > window``); a pair with neither ties.
    So a response is never scored on a scale it lacks (one token has no top-2, three tokens no two
    windows of 4), and responses cut from one entropy profile tie whatever their lengths: length has
    no lever. 0 off ``peers``.
    """
    _check_entropy_mask(entropy, mask)
    rows = entropy.shape[0]
    peers = peers.bool() & ~torch.eye(rows, dtype=torch.bool, device=peers.device)
    order = torch.zeros(rows, rows, dtype=torch.float64, device=entropy.device)
    first, second = peers.nonzero(as_tuple=True)
    if first.numel() == 0:
        return order
    n = (mask != 0).sum(dim=1)
    common = torch.minimum(n[first], n[second])
    local = torch.full((rows, rows), float("nan"), dtype=torch.float64, device=entropy.device)
    stability = torch.full_like(local, float("nan"))
    # Row ``first`` scored on its first ``common`` tokens, for every ordered pair; in chunks so that
    # a step of long responses does not hold pairs × tokens at once.
    per_chunk = max(1, chunk_elements // max(entropy.shape[1], 1))
    for at in range(0, first.numel(), per_chunk):
        i, j, m = first[at : at + per_chunk], second[at : at + per_chunk], common[at : at + per_chunk]
        cut = keep_first(mask[i], m)
        local[i, j] = local_exploration_score(entropy[i], cut, top_k).double()
        stability[i, j] = global_stability_score(entropy[i], cut, window).double()
    m = torch.minimum(n[:, None], n[None, :])
    has_local = peers & (m >= top_k)
    has_global = peers & (m > window)
    difference = torch.where(has_local, weight_local * (local - local.T), torch.zeros_like(local))
    difference = difference + torch.where(has_global, weight_global * (stability - stability.T), torch.zeros_like(local))
    return torch.where(peers, torch.sign(difference), order)


def order_from_scores(scores: torch.Tensor, peers: torch.Tensor) -> torch.Tensor:
    """``sign(scores_i - scores_j)`` on ``peers`` pairs, 0 elsewhere, shape [N, N] (scores: [N]); for
    orders given by one number per response: the placebo's random draw, the length-only control."""
    s = torch.nan_to_num(scores.double())
    rows = s.shape[0]
    peers = peers.bool() & ~torch.eye(rows, dtype=torch.bool, device=peers.device)
    return torch.where(peers, torch.sign(s[:, None] - s[None, :]), torch.zeros((), dtype=torch.float64))


def ranking_peers(ranked: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: ranked rows of the same group (each other's peers, a row its own)."""
    ranked = ranked.bool()
    return (group_index[:, None] == group_index[None, :]) & ranked[:, None] & ranked[None, :]


def ranking_bonus(
    order: torch.Tensor, tier: torch.Tensor, ranked: torch.Tensor, group_index: torch.Tensor, delta: float
) -> torch.Tensor:
    """Centred rank bonus in ``[-delta/2, delta/2]`` of the ranked rows, 0 elsewhere, shape [N].

    order: [N, N] pairwise outcome among peers (+1: row i above row j, 0: tie; ``pairwise_entropy_order``
    or ``order_from_scores``), consulted only between rows of equal tier; tier: [N] long, compared
    first (higher ranks higher); ranked: [N] bool, the rows to rank (failed, with response tokens);
    group_index: [N] long, rows ranked together. A row's rank is its wins over its peers plus half its
    ties (``n - 1`` pairs), so the ranks of a group sum to ``n(n-1)/2`` and the bonus sums to 0 over
    each group's ranked rows whatever the order; a lone ranked row gets 0.
    """
    if not (tier.shape == ranked.shape == group_index.shape) or tier.dim() != 1:
        raise ValueError(
            f"tier {tuple(tier.shape)}, ranked {tuple(ranked.shape)} and group_index {tuple(group_index.shape)} must all be [N]"
        )
    if order.shape != (tier.shape[0], tier.shape[0]):
        raise ValueError(f"order {tuple(order.shape)} must be [N, N] for N = {tier.shape[0]}")
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    peers = ranking_peers(ranked, group_index)
    others = peers & ~torch.eye(len(tier), dtype=torch.bool, device=peers.device)
    t = tier.long()
    wins = others & ((t[:, None] > t[None, :]) | ((t[:, None] == t[None, :]) & (order > 0)))
    ties = others & (t[:, None] == t[None, :]) & (order == 0)
    rank = wins.sum(dim=1).double() + 0.5 * ties.sum(dim=1).double()
    n_ranked = peers.sum(dim=1).double()
    bonus = delta * (rank / (n_ranked - 1).clamp(min=1) - 0.5)
    bonus = torch.where(ranked.bool() & (n_ranked > 1), bonus, torch.zeros_like(bonus))
    return bonus.to(_float_dtype(order))


def lowest_success_advantage(advantages: torch.Tensor, success: torch.Tensor) -> float:
    """The lowest advantage of a success among ``advantages`` [N] (``success``: [N] bool), +inf
    without one: the ceiling ``add_failure_bonus`` holds failures to."""
    success = success.bool()
    return float(advantages[success].min()) if success.any() else float("inf")


def add_failure_bonus(
    advantages: torch.Tensor, bonus: torch.Tensor, success: torch.Tensor, ceiling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N] with ``bonus`` added to the failed rows, capped rows [N] bool).

    advantages, bonus: [N]; success: [N] bool; ceiling: the lowest success advantage of the whole step
    (``lowest_success_advantage``, over every group, and every rank under DDP; +inf without a
    success). The bonus never lifts a failure above it, so no failure out-advantages a success of any
    group under any estimator (with ``dr_grpo`` or ``rloo`` at N = 16 a success of a 15/16 group gets
    +0.06, less than ``delta/2``). A failure the estimator itself put above the ceiling (non-binary
    rewards) keeps its advantage: the bonus may lower it, not raise it. ``capped`` marks where the cap
    acted.
    """
    if not (advantages.shape == bonus.shape == success.shape) or advantages.dim() != 1:
        raise ValueError(
            f"advantages {tuple(advantages.shape)}, bonus {tuple(bonus.shape)} and success {tuple(success.shape)} must all be [N]"
        )
    success = success.bool()
    raised = advantages + torch.where(success, torch.zeros_like(bonus), bonus)
    limit = torch.clamp(advantages, min=ceiling)
    capped = ~success & (raised > limit)
    return torch.where(capped, limit, raised), capped
