"""What each switched-on method component must show it did, and when its activity is degenerate.

A component that is configured on and never acts leaves every metric looking normal: R³'s in-context
episodes that end before their first token, success judgments the policy never writes, reflections that
are all invalid. ``component_checks`` lists, for one run's configuration, each component that is on with
the figure that proves it acted (summed over RL steps, it must be > 0) and, where one exists, the figure
that shows it degenerate. ``r3lightning.callbacks.ComponentHealth`` reads the logged figures against
these checks (docs/monitoring.md, "Component activity").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.replay import ReplayConfig
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.rollout.explorers.critique_refine import CritiqueRefineExplorer
from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer
from r3lightning.rollout.explorers.reflect_from_scratch import ReflectFromScratchExplorer
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer


@dataclass(frozen=True)
class Degeneracy:
    """A figure whose value over the checked steps says the component acts in name only.

    figure: the logged tag. threshold: the bound. reduce: how the steps' values are combined: ``mean``,
    ``abs_mean`` or ``first`` (its first logged value). above: degenerate at or above the bound (else at
    or below it). meaning: what it means, for the warning.
    """

    figure: str
    threshold: float
    reduce: Literal["mean", "abs_mean", "first"]
    above: bool
    meaning: str

    def holds(self, values: list[float]) -> Optional[float]:
        """The reduced figure when it is degenerate, else None (also None without values)."""
        if not values:
            return None
        if self.reduce == "first":
            value = values[0]
        elif self.reduce == "abs_mean":
            value = abs(sum(values) / len(values))
        else:
            value = sum(values) / len(values)
        degenerate = value >= self.threshold if self.above else value <= self.threshold
        return value if degenerate else None


@dataclass(frozen=True)
class ComponentCheck:
    """One switched-on component: its name, the config key that controls it, the figure whose sum over
    the checked RL steps must be > 0, and an optional degeneracy rule."""

    component: str
    key: str
    activity: str
    degenerate: Optional[Degeneracy] = None


INVALID_REFLECTIONS = Degeneracy(
    "rollout/reflection_invalid_rate", 0.95, "mean", True, "nearly every reflection was invalid, so no retry was guided"
)
FORMAT_REFUSALS = Degeneracy(
    "rollout/invalid_action_rate", 0.95, "mean", True,
    "nearly every action was refused by the format parser (the reward cannot be earned)",
)


def component_checks(
    algorithm: AlgorithmConfig, explorer: object, replay: ReplayConfig, agent: AgentLoopConfig
) -> list[ComponentCheck]:
    """The checks of every component this configuration switches on (the agent loop's action parser
    always: a format that refuses every answer makes any method inert)."""
    checks = [ComponentCheck(f"the agent loop's action parser ({agent.action_format!r})", "data.agent.action_format",
                             "rollout/generated_tokens", FORMAT_REFUSALS)]
    name = type(explorer).__name__
    if isinstance(explorer, InContextReflectionExplorer):
        checks.append(ComponentCheck(
            "R³ in-context reflection", f"data.explorer ({name}: share, after_failures)", "rollout/in_context_tokens"
        ))
    if isinstance(explorer, ReflectRetryExplorer) and explorer.retry:
        checks.append(ComponentCheck("R³L reflect-then-retry", f"data.explorer ({name}).retry", "rollout/retry_rate", INVALID_REFLECTIONS))
        if explorer.train_success_judgments:
            checks.append(ComponentCheck(
                "R³L success judgments", f"data.explorer ({name}).train_success_judgments",
                "rollout/success_judgment_samples",
            ))
        if explorer.meta_tasks and algorithm.meta_tasks_as == "positive_samples":
            checks.append(ComponentCheck(
                "R³L meta-tasks as +1 RL samples", "model.algorithm.meta_tasks_as", "rollout/meta_task_samples"
            ))
        elif explorer.meta_tasks and algorithm.sft_weight > 0:
            checks.append(ComponentCheck("R³L meta-task SFT", f"data.explorer ({name}).meta_tasks", "activity/sft_rows"))
    if isinstance(explorer, ReflectFromScratchExplorer):
        checks.append(ComponentCheck("Reflect-GRPO retries", f"data.explorer ({name})", "rollout/retry_rate", INVALID_REFLECTIONS))
    if isinstance(explorer, CritiqueRefineExplorer):
        checks.append(ComponentCheck("Critique-GRPO refinements", f"data.explorer ({name})", "rollout/critique_rate"))
    if replay.enabled:
        checks.append(ComponentCheck("R³ cross-context replay", "data.replay.enabled", "replay/injected"))
    if algorithm.ranking.enabled:
        # The length-only control is a function of length by design; the placebo's correlation is chance.
        checks.append(ComponentCheck(
            "R³ ranking of failures", "model.algorithm.ranking.enabled", "activity/ranked_failures",
            Degeneracy("activity/ranking_length_corr", 0.95, "abs_mean", True,
                       "the ranking bonus is a function of response length, not of exploration")
            if algorithm.ranking.order == "entropy" else None,
        ))
    if algorithm.pivotal_credit:
        checks.append(ComponentCheck("R³L pivotal credit", "model.algorithm.pivotal_credit", "activity/pivot_masked_rows"))
    if algorithm.positive_amplification:
        checks.append(ComponentCheck("R³L positive amplification", "model.algorithm.positive_amplification", "activity/amplified_rows"))
    return checks


TEACHER_CHECK = ComponentCheck(
    "ReflectRL teacher KL", "model.phases.distill.beta", "distill/kl_teacher",
    Degeneracy("distill/kl_teacher", 1e-9, "first", False,
               "the teacher was identical to the student when distillation began (the KL only anchors)"),
)
"""Added by the health callback when a teacher is set (ReflectRL's distillation phase)."""
