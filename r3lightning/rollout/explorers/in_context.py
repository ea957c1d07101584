"""R³'s in-context self-reflection: a task that keeps failing gets part of its group generated with a
past failed attempt in the prompt, and an instruction to find its mistake.

Jiang et al., arXiv 2601.19620 (our reading; docs/r3.md). Per task: when the task failed on its last
``after_failures`` visits and the datamodule's history holds a failed attempt of it, ``share`` of the
group's ``group_size`` episodes show that attempt (the ``in_context.txt`` template, inside the agent
loop's guidance block of the first turn); the others are plain samples. The in-context samples are
trained under the augmented prompt (origin ``in_context``: their tokens were sampled there, so their
behaviour log-probs are exact), or, with ``distill``, under the plain prompt with the attempt removed
(origin ``distilled``, the context distillation R³L uses). Works for single-turn math (the attempt is
its answer and feedback) and multi-turn worlds (each step's action and feedback).
"""

from __future__ import annotations

from typing import Optional

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, ExplorerTraits, GuidanceBudget
from r3lightning.rollout.explorers.reflect_from_scratch import distill_from_scratch
from r3lightning.rollout.explorers.reflection import load_template, step_lines
from r3lightning.types import Group, Trajectory


def attempt_text(trajectory: Trajectory, tokenizer) -> str:
    """A past attempt as the prompt shows it: a single-turn answer in full with its feedback, or one
    ``Step i: action -> feedback`` line per turn."""
    if len(trajectory.turns) == 1:
        turn = trajectory.turns[0]
        answer = tokenizer.decode(turn.response_ids, skip_special_tokens=True).strip() or "(empty)"
        return f"{answer}\nFeedback: {turn.feedback or '(no feedback)'}"
    return "\n".join(step_lines(trajectory)) or "(no steps)"


class InContextReflectionExplorer:
    """R³'s in-context self-reflection (``in_context``); plain sampling for tasks without a failure streak.

    Args:
        share: the part of a group generated with a past failed attempt in context, for the tasks that
            qualify (at least one episode each).
        after_failures: a task qualifies when it failed on this many consecutive visits (a visit fails
            when no sample of its group succeeded).
        distill: train the in-context samples under the plain prompt (context distillation) instead of
            the augmented one they were sampled under.
        template: path of the in-context template with an ``{attempt}`` field; empty for the built-in.
    """

    def __init__(self, share: float = 0.5, after_failures: int = 2, distill: bool = False, template: str = "") -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"InContextReflectionExplorer: share must be in (0, 1], got {share}")
        if after_failures < 1:
            raise ValueError(f"InContextReflectionExplorer: after_failures must be >= 1, got {after_failures}")
        self.share = share
        self.after_failures = after_failures
        self.distill = distill
        self.template = load_template(template, "in_context.txt")

    @property
    def traits(self) -> ExplorerTraits:
        return ExplorerTraits(uses_history=True, distilled_samples=self.distill)

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        """The template around a past answer of at most ``max_new_tokens`` tokens and ``feedback``, the
        longest the suite writes (``attempt_text``'s layout; ``(no feedback)`` when none is declared)."""
        return GuidanceBudget(
            self.template.format(attempt=f"\nFeedback: {feedback or '(no feedback)'}").strip(), sampling.max_new_tokens
        )

    def past_failure(self, task: Task, spec: ExplorationSpec) -> Trajectory | None:
        """A stored failed attempt of ``task`` when the task is on a failure streak, else None."""
        history = spec.history
        if history is None or not history.recent_failures(task.task_id, self.after_failures):
            return None
        found = history.sample(task.task_id, want_success=False, k=1, rng=spec.rng)
        return found[0][0] if found else None

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        n = spec.group_size
        in_context = max(1, round(self.share * n))
        requests, counts = [], []
        for task in tasks:
            failure = self.past_failure(task, spec)
            guided = in_context if failure is not None else 0
            counts.append(guided)
            requests += [EpisodeRequest(task=task) for _ in range(n - guided)]
            if guided:
                guidance = self.template.format(attempt=attempt_text(failure, loop.tokenizer)).strip()
                requests += [EpisodeRequest(task=task, origin="in_context", guidance=guidance) for _ in range(guided)]
        runs = loop.run(requests, spec.sampling)
        groups, start, dropped = [], 0, 0
        for task, guided in zip(tasks, counts):
            members = runs[start : start + n]
            start += n
            if self.distill and guided:
                kept = [distill_from_scratch(t, "distilled") if t.origin == "in_context" and t.guided_turn else t for t in members]
                dropped += sum(t.origin == "in_context" for t in kept)  # never played a turn: nothing to distill
                members = [t for t in kept if t.origin != "in_context"]
            groups.append(Group(task.task_id, members, task))
        guided_runs = [t for t in runs if t.origin == "in_context"]
        # The premise gate: the plain samples of the same qualifying tasks, in the same step.
        qualifying = {task.task_id for task, guided in zip(tasks, counts) if guided}
        plain_runs = [t for t in runs if t.origin != "in_context" and t.task_id in qualifying]
        return Exploration(
            groups=groups,
            metrics={
                "rollout/in_context_task_rate": sum(c > 0 for c in counts) / max(len(tasks), 1),
                "rollout/in_context_success_rate": sum(t.success for t in guided_runs) / len(guided_runs) if guided_runs else 0.0,
                "rollout/in_context_plain_success_rate": sum(t.success for t in plain_runs) / len(plain_runs) if plain_runs else 0.0,
                "rollout/in_context_dropped": float(dropped),
                "rollout/in_context_episodes": float(len(guided_runs)),
                "rollout/in_context_tokens": float(sum(t.num_response_tokens for t in guided_runs)),
                # Episodes that ended before their first token (their prompt filled the context).
                "rollout/in_context_unplayed": float(sum(t.num_response_tokens == 0 for t in guided_runs)),
            },
        )
