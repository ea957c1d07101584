"""Pure-torch algorithm core: advantages, masks, policy/SFT/KL losses, aggregation, ranking bonus, pass@k.

Imports neither lightning, transformers nor vllm (tested), so the math can be read, tested and
reused on its own, the way verl's core_algos is.
"""

from r3lightning.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_mean_std,
    positive_amplification,
    zero_variance_group_rate,
)
from r3lightning.algos.kl import full_kl, kl_estimate
from r3lightning.algos.logprobs import (
    entropy_from_logits,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    shift_logits_and_labels,
)
from r3lightning.algos.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossOutput,
    aggregate,
    masked_mean,
    policy_loss,
    sft_nll,
    shaped_off_policy_loss,
)
from r3lightning.algos.masks import pivotal_mask
from r3lightning.algos.pass_at_k import mean_at_k, pass_at_k
from r3lightning.algos.ranking import (
    add_failure_bonus,
    global_stability_score,
    local_exploration_score,
    lowest_success_advantage,
    order_from_scores,
    pairwise_entropy_order,
    ranking_bonus,
    ranking_peers,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "add_failure_bonus",
    "aggregate",
    "compute_advantages",
    "entropy_from_logits",
    "full_kl",
    "global_stability_score",
    "group_mean_std",
    "kl_estimate",
    "local_exploration_score",
    "lowest_success_advantage",
    "masked_mean",
    "mean_at_k",
    "order_from_scores",
    "pairwise_entropy_order",
    "pass_at_k",
    "pivotal_mask",
    "policy_loss",
    "positive_amplification",
    "ranking_bonus",
    "ranking_peers",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "sft_nll",
    "shaped_off_policy_loss",
    "shift_logits_and_labels",
    "zero_variance_group_rate",
]
