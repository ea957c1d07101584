"""Reflect-GRPO exploration: reflect on each failed trajectory, retry it from scratch, distill the retry.

The baseline of the R³L paper (DESIGN.md §4, explorer ``reflect_from_scratch``). Per task:
``group_size // 2`` base trajectories; each failed one (reward below ``max_reward``) gets an R³L
reflection from the same policy (same prompt, parser and guidance as ``reflect_retry``); a valid
reflection triggers a retry in a fresh environment with the guidance shown from the first turn; the
retry with its guidance removed joins the group as a ``distilled`` trajectory. Unlike R³L there is no
pivot (nothing is replayed, so no prefix is shared and nothing is masked) and no meta-task SFT.
"""

from __future__ import annotations

import dataclasses

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.explorers import Exploration
from r3lightning.rollout.reflect_retry import ReflectRetryExplorer, distill, retry_is_better
from r3lightning.types import Group, Trajectory


def distill_from_scratch(retry: Trajectory, origin: str) -> Trajectory:
    """A retry that started from scratch with its guidance removed (``distill``), as a trajectory of
    ``origin`` without pivot: it shares no prefix with any other trajectory, so pivotal credit has
    nothing to mask in it."""
    return dataclasses.replace(distill(retry, pivot=0), origin=origin, pivot=None)


def usable_retry(retry: Trajectory) -> bool:
    """A guided episode can join a group when its reward is sound and its guided first turn was
    played (a prompt that does not fit the context ends the episode before any turn)."""
    return not retry.reward_error and "unguided_context" in retry.info


def failed(trajectory: Trajectory, max_reward: float) -> bool:
    """Below the maximum reward; a sample whose reward errored is not known to have failed."""
    return trajectory.reward < max_reward and not trajectory.reward_error


class ReflectFromScratchExplorer(ReflectRetryExplorer):
    """Reflect-GRPO's exploration (``reflect_from_scratch``): R³L's reflections, retries from scratch.

    The reflection's ``trajectory_outcome`` and ``retry_from_step`` are parsed and validated as in
    R³L (so invalid rates compare), but neither decides anything here: the reward already says the
    trajectory failed, and the retry always starts at the first turn.

    Args:
        reflection_temperature: sampling temperature of reflections.
        max_reflection_tokens: generation budget of one reflection.
        max_reward: reward at or above which a base trajectory counts as solved (not reflected on).
        reflection_template: path of a reflection prompt template with ``{transcript}`` and
            ``{outcome}`` fields; empty for R³L's built-in one.
        guidance_template: path of a guidance template with the reflection's field names; empty for
            R³L's built-in one.
    """

    def __init__(
        self,
        reflection_temperature: float = 1.0,
        max_reflection_tokens: int = 192,
        max_reward: float = 1.0,
        reflection_template: str = "",
        guidance_template: str = "",
    ) -> None:
        super().__init__(
            retry=True,
            reflection_temperature=reflection_temperature,
            max_reflection_tokens=max_reflection_tokens,
            meta_tasks=False,
            max_reward=max_reward,
            reflection_template=reflection_template,
            guidance_template=guidance_template,
        )

    def explore(self, tasks: list[Task], loop: AgentLoop, group_size: int, params: SamplingParams) -> Exploration:
        n_base = max(1, group_size // 2)
        base = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n_base)], params)
        reflected = [i for i, traj in enumerate(base) if failed(traj, self.max_reward)]
        _, _, parsed = self.reflect(loop, [base[i] for i in reflected], [tasks[i // n_base] for i in reflected], params)
        valid = [(i, reflection) for i, (reflection, _) in zip(reflected, parsed) if reflection is not None]
        retry_of = [i for i, _ in valid]
        requests = [EpisodeRequest(task=tasks[i // n_base], guidance=self.guidance(r)) for i, r in valid]
        retries = loop.run(requests, params)
        distilled = {i: distill_from_scratch(r, "distilled") for i, r in zip(retry_of, retries) if usable_retry(r)}
        improved = sum(retry_is_better(base[i], r, self.max_reward) for i, r in zip(retry_of, retries) if i in distilled)
        groups = []
        for ti, task in enumerate(tasks):
            members = []
            for i in range(ti * n_base, (ti + 1) * n_base):
                members.append(base[i])
                if i in distilled:
                    members.append(distilled[i])
            groups.append(Group(task.task_id, members, task))
        counts = {
            "base": len(base),
            "reflections": len(parsed),
            "invalid": len(parsed) - len(retry_of),
            "retries": len(retries),
            "unusable": len(retries) - len(distilled),
            "improved": improved,
        }
        return Exploration(groups=groups, metrics=reflect_grpo_metrics(counts))


def reflect_grpo_metrics(counts: dict[str, int]) -> dict[str, float]:
    """Rates under R³L's tags where the figure means the same (reflections written only on failures,
    so the invalid rate is per reflection written); ``retry_unusable_rate`` counts retries that could
    not join the group (errored reward, or no turn played)."""
    return {
        "rollout/reflection_rate": counts["reflections"] / max(counts["base"], 1),
        "rollout/reflection_invalid_rate": counts["invalid"] / max(counts["reflections"], 1),
        "rollout/retry_rate": counts["retries"] / max(counts["base"], 1),
        "rollout/retry_unusable_rate": counts["unusable"] / max(counts["retries"], 1),
        "rollout/retry_improvement_rate": counts["improved"] / max(counts["retries"], 1),
    }
