"""Explorer × objective pairs that would silently do nothing are refused before training starts.

The table of valid pairs is in docs/configuration.md ("Valid combinations"); this is its executable
form. Errors name both keys; pairs that are legitimate but easy to get wrong give one warning.
"""

from __future__ import annotations

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.rollout.explorers.base import ExplorerTraits


def check_combination(objective: AlgorithmConfig, explorer: object, demo_reflections: bool) -> list[str]:
    """Raise ``ValueError`` for a pair that cannot work; return warnings for pairs that are allowed
    but probably not meant. ``explorer`` has a ``traits`` attribute (``ExplorerTraits``)."""
    traits: ExplorerTraits = explorer.traits
    name = type(explorer).__name__
    if objective.pivotal_credit and not traits.sets_pivots:
        raise ValueError(
            f"model.algorithm.pivotal_credit: true does nothing with data.explorer {name}, which never sets "
            "pivots; set pivotal_credit: false, or use ReflectRetryExplorer with retry: true"
        )
    if objective.off_policy_gamma is not None and not traits.off_policy_samples:
        raise ValueError(
            f"model.algorithm.off_policy_gamma: {objective.off_policy_gamma} does nothing with data.explorer "
            f"{name}, which makes no off-policy samples; set off_policy_gamma: null"
        )
    if traits.off_policy_samples and objective.off_policy_gamma is None:
        raise ValueError(
            f"data.explorer {name} makes off-policy samples, which need model.algorithm.off_policy_gamma "
            "(Critique-GRPO's shaping π/(π+γ); the paper uses 0.1)"
        )
    if objective.meta_tasks_as == "positive_samples" and objective.policy_loss != "pg" and not objective.recompute_old_logprobs:
        raise ValueError(
            f"model.algorithm.meta_tasks_as: positive_samples with policy_loss: {objective.policy_loss} needs "
            "recompute_old_logprobs: true (meta-task samples have no behaviour log-probs), or policy_loss: pg"
        )
    warnings = []
    if demo_reflections and not traits.reflects:
        # Legitimate: every method of a comparison can share one warm-start, reflections included.
        warnings.append(
            f"model.phases.warmstart.demos.reflections: true with data.explorer {name}, which never reflects: the warm-start "
            "teaches reflections this method will not ask for"
        )
    sft_head_samples = traits.sft_samples and objective.meta_tasks_as == "sft_head"
    if objective.sft_weight > 0 and not sft_head_samples:
        warnings.append(
            f"model.algorithm.sft_weight: {objective.sft_weight} has no effect during RL: data.explorer {name} "
            f"with meta_tasks_as: {objective.meta_tasks_as} hands no samples to the SFT head (the warm-start's "
            "demonstrations always weigh 1)"
        )
    if sft_head_samples and objective.sft_weight == 0:
        warnings.append(
            f"data.explorer {name} makes meta-task SFT samples, but model.algorithm.sft_weight is 0: they are "
            "generated and then ignored"
        )
    if traits.distilled_samples and objective.policy_loss != "pg" and not objective.recompute_old_logprobs:
        warnings.append(
            f"model.algorithm.policy_loss: {objective.policy_loss} with data.explorer {name}: distilled samples "
            "were drawn under guidance, so their importance ratio compares two contexts (R³L uses pg; "
            "recompute_old_logprobs: true scores them without guidance first)"
        )
    return warnings
