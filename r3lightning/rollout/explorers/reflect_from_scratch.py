"""Reflect-GRPO exploration: reflect on failed attempts, retry them from scratch, distill the retries.

The baseline of the R³L paper, as its reference code runs it (explorer ``reflect_from_scratch``). Per
task: ``group_size`` fresh samples. The failed ones (reward below ``data.max_reward``) among the second
half of the group get an R³L reflection from the same policy (same prompt, parser and guidance as
``reflect_retry``); a valid reflection that does not claim ``success`` triggers a retry in a fresh
environment with the guidance shown from the first turn; the retry with its guidance removed joins
the group as a ``distilled`` trajectory. Groups have ``group_size`` to ``1.5 · group_size`` members.
Unlike R³L there is no pivot (nothing is replayed, so no prefix is shared and nothing is masked) and no
meta-task SFT.
"""

from __future__ import annotations

from typing import Literal, Optional

import dataclasses

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, ExplorerTraits, GuidanceBudget
from r3lightning.rollout.explorers.reflect_retry import distill, retry_is_better
from r3lightning.rollout.explorers.reflection import (
    MAX_REFLECTION_TOKENS,
    REFLECTION_TEMPERATURE,
    Reflector,
    reflection_templates,
)
from r3lightning.types import Group, Trajectory


def distill_from_scratch(retry: Trajectory, origin: str) -> Trajectory:
    """A retry that started from scratch with its guidance removed (``distill``), as a trajectory of
    ``origin`` without pivot: it shares no prefix with any other trajectory, so pivotal credit has
    nothing to mask in it."""
    return dataclasses.replace(distill(retry, pivot=0), origin=origin, pivot=None)


def usable_retry(retry: Trajectory) -> bool:
    """A guided episode can join a group when its reward is sound and its guided first turn was
    played (a prompt that does not fit the context ends the episode before any turn)."""
    return not retry.reward_error and retry.guided_turn is not None


def failed(trajectory: Trajectory, max_reward: float) -> bool:
    """Below the maximum reward; a sample whose reward errored is not known to have failed."""
    return trajectory.reward < max_reward and not trajectory.reward_error


class ReflectFromScratchExplorer:
    """Reflect-GRPO's exploration (``reflect_from_scratch``): R³L's reflections, retries from scratch.

    The reflection's ``retry_from_step`` is parsed and validated as in R³L (so invalid rates compare)
    but not used: the retry always starts at the first turn. A ``success`` verdict means no retry, as in
    the reference code.

    Args:
        reflection_temperature: sampling temperature of reflections.
        max_reflection_tokens: generation budget of one reflection.
        reflection_template: path of a reflection prompt template with ``{transcript}`` and
            ``{outcome}`` fields; empty for R³L's built-in one.
        guidance_template: path of a guidance template with the reflection's field names; empty for
            R³L's built-in one.
        reflected_share: the share of each group's fresh samples that are candidates for reflection
            (the last ones); the reference code reflects on the failures of the second half (0.5).
        reflection_format: ``json`` (the paper's object, as R³L's) or ``text``: free text, the guidance
            of the retry as it is, for a policy that cannot yet write the object (as R³L's
            ``reflection_format``). A text judges no outcome, so every failed candidate is retried.
    """

    traits = ExplorerTraits(distilled_samples=True, reflects=True)

    def __init__(
        self,
        reflection_temperature: float = REFLECTION_TEMPERATURE,
        max_reflection_tokens: int = MAX_REFLECTION_TOKENS,
        reflection_template: str = "",
        guidance_template: str = "",
        reflected_share: float = 0.5,
        reflection_format: Literal["json", "text"] = "json",
    ) -> None:
        if not 0.0 < reflected_share <= 1.0:
            raise ValueError(f"ReflectFromScratchExplorer: reflected_share must be in (0, 1], got {reflected_share}")
        self.reflected_share = reflected_share
        self.reflector = Reflector(
            reflection_temperature,
            max_reflection_tokens,
            *reflection_templates(reflection_template, guidance_template, reflection_format),
            reflection_format=reflection_format,
        )

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        return self.reflector.guidance_budget()

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        params, max_reward, n = spec.sampling, spec.max_reward, spec.group_size
        fresh = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n)], params)
        first_candidate = n - max(1, round(n * self.reflected_share))
        reflected = [i for i, traj in enumerate(fresh) if i % n >= first_candidate and failed(traj, max_reward)]
        parsed = self.reflector.reflect(loop, [fresh[i] for i in reflected], [tasks[i // n] for i in reflected], params).parsed
        valid = [(i, r) for i, (r, _) in zip(reflected, parsed) if r is not None and r.trajectory_outcome != "success"]
        retry_of = [i for i, _ in valid]
        requests = [EpisodeRequest(task=tasks[i // n], guidance=self.reflector.guidance(r)) for i, r in valid]
        retries = loop.run(requests, params) if requests else []
        distilled = {i: distill_from_scratch(r, "distilled") for i, r in zip(retry_of, retries) if usable_retry(r)}
        improved = sum(retry_is_better(fresh[i], r, max_reward) for i, r in zip(retry_of, retries) if i in distilled)
        groups = []
        for ti, task in enumerate(tasks):
            members = list(fresh[ti * n : (ti + 1) * n])
            members += [distilled[i] for i in range(ti * n, (ti + 1) * n) if i in distilled]
            groups.append(Group(task.task_id, members, task))
        counts = {
            "candidates": len(tasks) * (n - first_candidate),
            "reflections": len(parsed),
            "invalid": sum(r is None for r, _ in parsed),
            "judged_success": sum(r is not None and r.trajectory_outcome == "success" for r, _ in parsed),
            "retries": len(retries),
            "unusable": len(retries) - len(distilled),
            "improved": improved,
        }
        return Exploration(groups=groups, metrics=reflect_grpo_metrics(counts))


def reflect_grpo_metrics(counts: dict[str, int]) -> dict[str, float]:
    """Rates under R³L's tags where the figure means the same (reflections are written only on failed
    candidates, so the invalid rate is per reflection written); ``retry_unusable_rate`` counts retries
    that could not join the group (errored reward, or no turn played)."""
    return {
        "rollout/reflection_rate": counts["reflections"] / max(counts["candidates"], 1),
        "rollout/reflection_invalid_rate": counts["invalid"] / max(counts["reflections"], 1),
        "rollout/reflection_claims_success_rate": counts["judged_success"] / max(counts["reflections"], 1),
        "rollout/retry_rate": counts["retries"] / max(counts["candidates"], 1),
        "rollout/retry_unusable_rate": counts["unusable"] / max(counts["retries"], 1),
        "rollout/retry_improvement_rate": counts["improved"] / max(counts["retries"], 1),
    }
