"""R³L exploration: reflect on each base trajectory, retry from its pivot, distill the retry.

Per task (docs/r3l.md): ``group_size // 2`` base trajectories; the same policy writes a structured
JSON reflection of each (``explorers.reflection``); a valid, non-``success`` reflection triggers a retry
from ``retry_from_step`` k (fresh environment, first k actions replayed with their original tokens,
guidance shown with the pivot observation only); the retry's guidance is then removed (context
distillation) and the distilled trajectory joins the base ones in the group. Both members of a
base/distilled pair carry the pivot, so pivotal credit masks their shared prefix. When the retry
improves on the base, a reflect sample and a retry sample are added for the SFT head.

Single-turn reasoning (``step_split: auto`` and a suite with ``max_turns == 1``) pivots on steps
instead of turns: the response is split into steps (``rollout.steps``), the reflection sees them
numbered, and the retry continues the same assistant message from the first k steps' tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, ExplorerTraits, GuidanceBudget, sample_groups
from r3lightning.rollout.explorers.reflection import (
    MAX_REFLECTION_TOKENS,
    REFLECTION_TEMPERATURE,
    Reflection,
    Reflector,
    diagnosis_of,
    reflection_templates,
)
from r3lightning.rollout.steps import split_final_turn
from r3lightning.types import Group, Trajectory, Turn


def distill(retry: Trajectory, pivot: int) -> Trajectory:
    """The retry with its guidance removed: the guided turn gets the context it would have had
    without guidance; every generated token is kept as generated."""
    if retry.guided_turn is None:
        raise ValueError(f"retry of task {retry.task_id!r} has no guided turn to distill (it ended before turn {pivot})")
    turns = list(retry.turns)
    index = retry.guided_turn.index
    turns[index] = dataclasses.replace(turns[index], context_ids=list(retry.guided_turn.unguided_context))
    return dataclasses.replace(retry, turns=turns, origin="distilled", pivot=pivot, guided_turn=None)


def retry_is_better(base: Trajectory, retry: Trajectory, max_reward: float) -> bool:
    """The retry beats the base and reaches the maximum, or both succeed and it is shorter."""
    if retry.reward > base.reward and retry.reward >= max_reward:
        return True
    return retry.success and base.success and len(retry.turns) < len(base.turns)


class ReflectRetryExplorer:
    """R³L's language-guided exploration (``reflect_retry``).

    Args:
        retry: reflect and retry; false gives the ``r3l_wo_reflect`` ablation (all ``group_size``
            trajectories are plain samples, nothing else changes).
        reflection_temperature: sampling temperature of reflections.
        max_reflection_tokens: generation budget of one reflection.
        meta_tasks: add reflect and retry SFT samples when a retry improves on its base.
        reflection_template: path of a reflection prompt template with ``{transcript}`` and
            ``{outcome}`` fields; empty for the built-in one.
        guidance_template: path of a guidance template with the reflection's field names; empty for
            the built-in one.
        retry_below_max_reward_only: retry only trajectories whose reward is below ``data.max_reward``,
            whatever their reflection's outcome says. The paper trusts the reflection (``success`` →
            no retry); a small policy's self-assessment is unreliable
            (``rollout/reflection_outcome_agreement``), and the retry of a trajectory that already
            has the maximum reward can at best tie it, so that half of the budget is better spent on
            failures. This also skips the retries of inefficient successes.
        refill_groups: where a base trajectory got no retry (its reflection was invalid or said
            ``success``, the gate above skipped it, or the retry failed to run), sample a fresh
            trajectory of the task instead, so every group keeps ``group_size`` members and the
            rollout budget stays that of GRPO. Off in the paper, whose groups shrink. The fresh
            samples are plain base trajectories (no reflection); ``rollout/refill_rate`` is their
            share of the group slots.
        reflector: who writes the reflections. ``policy`` (the paper): the policy itself, in one
            batched generation. ``suite``: the suite's scripted diagnostician (``TaskSuite.diagnose``),
            which knows the optimal plan: a privileged reflector that isolates the retry mechanism
            (pivot, guidance, distillation, pivotal credit) from the quality of the policy's own
            reflections, the stand-in for a stronger reflector model at CPU scale. With
            ``meta_tasks``, the reflect samples then teach the policy the diagnostician's reflections
            on its own episodes. Needs a suite with a diagnostician (the procedural world).
        reflection_transcript: how the episode is shown to the reflector: ``compact`` (first
            observation, then ``action -> feedback`` per step; short prompts for small policies) or
            ``full`` (the reference code's: system prompt, every observation, full response, feedback).
        train_success_judgments: with ``meta_tasks``, also train the reflection of a maximum-reward
            episode that the reflection correctly judged ``success`` (the reference code does): the
            signal that teaches the policy to judge its own outcomes. Counted in
            ``rollout/success_judgment_samples``. A ``text`` reflection judges nothing, so none is trained.
        reflection_format: ``json`` (the paper's object: summary, root cause, outcome, suggestion,
            ``retry_from_step``) or ``text``: free text, for a policy that cannot yet write the object
            (a 135M model writes it valid about never); its outcome is the environment's verdict, its
            pivot the first ``Step k`` it names, else 0 (``reflection.parse_text_reflection``). The
            built-in templates follow the format (``reflection_text.txt``, ``guidance_text.txt``).
        step_split: ``auto``: when the suite plays one turn per episode (``max_turns == 1``, single-turn
            reasoning), pivot on reasoning steps — responses are split into lines
            (``rollout.steps.step_lengths``) and the retry continues the message from the first k
            steps; otherwise pivot on turns. ``off``: always turns (a single-turn retry restarts
            from scratch).
    """

    def __init__(
        self,
        retry: bool = True,
        reflection_temperature: float = REFLECTION_TEMPERATURE,
        max_reflection_tokens: int = MAX_REFLECTION_TOKENS,
        meta_tasks: bool = True,
        reflection_template: str = "",
        guidance_template: str = "",
        step_split: Literal["auto", "off"] = "auto",
        retry_below_max_reward_only: bool = False,
        refill_groups: bool = False,
        reflector: Literal["policy", "suite"] = "policy",
        reflection_transcript: Literal["compact", "full"] = "compact",
        train_success_judgments: bool = True,
        reflection_format: Literal["json", "text"] = "json",
    ) -> None:
        if step_split not in ("auto", "off"):
            raise ValueError(f"step_split must be 'auto' or 'off', got {step_split!r}")
        self.retry = retry
        self.meta_tasks = meta_tasks
        self.step_split = step_split
        self.retry_below_max_reward_only = retry_below_max_reward_only
        self.refill_groups = refill_groups
        self.train_success_judgments = train_success_judgments
        self.reflector = Reflector(
            reflection_temperature,
            max_reflection_tokens,
            *reflection_templates(reflection_template, guidance_template, reflection_format),
            source=reflector,
            transcript_style=reflection_transcript,
            reflection_format=reflection_format,
        )

    @property
    def traits(self) -> ExplorerTraits:
        if not self.retry:
            return ExplorerTraits(reflects=True)
        return ExplorerTraits(sets_pivots=True, sft_samples=self.meta_tasks, distilled_samples=True, reflects=True)

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        """A retry from the first turn shows the reflection's guidance with the task's prompt."""
        return self.reflector.guidance_budget() if self.retry else None

    def step_level(self, loop: AgentLoop) -> bool:
        """Whether pivots are reasoning steps (see ``step_split``)."""
        return self.step_split == "auto" and loop.suite.max_turns == 1

    # ---- exploration --------------------------------------------------------------------------
    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        if not self.retry:
            return Exploration(groups=sample_groups(tasks, loop, spec))
        params = spec.sampling
        n_base = max(1, spec.group_size // 2)
        base = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n_base)], params)
        step_level = self.step_level(loop)
        if step_level:
            base = [split_final_turn(t, loop.tokenizer) for t in base]
        base_tasks = [t for t in tasks for _ in range(n_base)]
        reflections = self.reflector.reflect(loop, base, base_tasks, params, step_level)
        retry_of: list[int] = []
        pivots: list[int] = []
        requests = []
        for i, (traj, (reflection, _)) in enumerate(zip(base, reflections.parsed)):
            if not self.wants_retry(traj, reflection, spec.max_reward):
                continue
            k = reflection.retry_from_step
            retry_of.append(i)
            pivots.append(k)
            # A step pivot continues the one message from its first k steps; a turn pivot replays k turns.
            prefix = {"response_prefix": traj.turns[:k]} if step_level else {"prefix": traj.turns[:k]}
            requests.append(EpisodeRequest(task=tasks[i // n_base], guidance=self.reflector.guidance(reflection), **prefix))
        retries = loop.run(requests, params) if requests else []
        if step_level:
            # The continuation is the last turn; splitting it keeps the k verbatim steps as they are.
            retries = [split_final_turn(r, loop.tokenizer) for r in retries]
        distilled_by_base: dict[int, Trajectory] = {}
        sft: list[Trajectory] = []
        improved = 0
        for i, k, retry in zip(retry_of, pivots, retries):
            if retry.reward_error or retry.guided_turn is None:
                continue
            distilled_by_base[i] = distill(retry, k)
            if k > 0:
                base[i] = dataclasses.replace(base[i], pivot=k)
            if retry_is_better(base[i], retry, spec.max_reward):
                improved += 1
                if self.meta_tasks:
                    sft.extend(meta_task_samples(base[i], reflections.prompts[i], reflections.answers[i], retry, k))
        judged = self.success_judgment_samples(base, reflections, spec.max_reward)
        sft.extend(judged)
        refills = self.refill(loop, tasks, spec, n_base, distilled_by_base, step_level)
        groups = []
        for ti, task in enumerate(tasks):
            members = []
            for i in range(ti * n_base, (ti + 1) * n_base):
                members.append(base[i])
                if i in distilled_by_base:
                    members.append(distilled_by_base[i])
            groups.append(Group(task.task_id, members + refills[ti], task))
        metrics = r3l_metrics(base, reflections.parsed, retry_of, pivots, improved)
        if not step_level:
            metrics.update(pivot_agreement(loop.suite, base_tasks, base, reflections.parsed))
            metrics.update(success_label_agreement(loop.suite, base_tasks, base, reflections.parsed))
        metrics["rollout/replay_failures"] = float(sum(r.end_reason == "replay_failed" for r in retries))
        metrics["rollout/success_judgment_samples"] = float(len(judged))
        metrics["rollout/meta_task_samples"] = float(len(sft) - len(judged))
        metrics["rollout/refill_rate"] = sum(len(r) for r in refills) / (len(tasks) * spec.group_size)
        return Exploration(groups=groups, sft=sft, metrics=metrics)

    def success_judgment_samples(self, base: list[Trajectory], reflections, max_reward: float) -> list[Trajectory]:
        """Reflect samples for maximum-reward episodes whose reflection said ``success`` (with
        ``meta_tasks`` and ``train_success_judgments``)."""
        if not (self.meta_tasks and self.train_success_judgments):
            return []
        samples = []
        for i, (trajectory, (reflection, _)) in enumerate(zip(base, reflections.parsed)):
            correct = reflection is not None and reflection.judged and reflection.trajectory_outcome == "success"
            if correct and trajectory.reward >= max_reward and not trajectory.reward_error:
                samples.append(reflect_sample(trajectory, reflections.prompts[i], reflections.answers[i], trajectory.reward))
        return samples

    def wants_retry(self, trajectory: Trajectory, reflection: Reflection | None, max_reward: float) -> bool:
        """A valid reflection that does not claim success, on a sound reward (and, with
        ``retry_below_max_reward_only``, a reward below the maximum)."""
        if reflection is None or reflection.trajectory_outcome == "success" or trajectory.reward_error:
            return False
        return not (self.retry_below_max_reward_only and trajectory.reward >= max_reward)

    def refill(
        self,
        loop: AgentLoop,
        tasks: list[Task],
        spec: ExplorationSpec,
        n_base: int,
        distilled_by_base: dict[int, Trajectory],
        step_level: bool,
    ) -> list[list[Trajectory]]:
        """Fresh samples per task for the slots no retry filled (``refill_groups``), in one engine call."""
        if not self.refill_groups:
            return [[] for _ in tasks]
        missing = [
            spec.group_size - n_base - sum(i in distilled_by_base for i in range(ti * n_base, (ti + 1) * n_base))
            for ti in range(len(tasks))
        ]
        requests = [EpisodeRequest(task=task) for task, count in zip(tasks, missing) for _ in range(count)]
        fresh = loop.run(requests, spec.sampling) if requests else []
        if step_level:
            fresh = [split_final_turn(t, loop.tokenizer) for t in fresh]
        in_order = iter(fresh)
        return [[next(in_order) for _ in range(count)] for count in missing]


def meta_task_samples(
    base: Trajectory, reflect_prompt: list[int], reflection_ids: list[int], retry: Trajectory, pivot: int
) -> list[Trajectory]:
    """Reflect sample ([trajectory, feedback] -> reflection) and retry sample (prefix + guidance ->
    corrected suffix; the replayed prefix is context only)."""
    reflect = reflect_sample(base, reflect_prompt, reflection_ids, retry.reward)
    turns = [dataclasses.replace(t, trainable=False) for t in retry.turns[:pivot]] + list(retry.turns[pivot:])
    retry_sample = dataclasses.replace(retry, turns=turns, origin="retry_sft", pivot=None, info={}, guided_turn=None)
    return [reflect, retry_sample]


def reflect_sample(trajectory: Trajectory, prompt: list[int], reflection_ids: list[int], reward: float) -> Trajectory:
    """The reflection on ``trajectory`` as an SFT sample: its prompt, then the reflection written."""
    return Trajectory(
        task_id=trajectory.task_id,
        turns=[Turn(context_ids=list(prompt), response_ids=list(reflection_ids))],
        reward=reward,
        success=True,
        origin="reflect_sft",
    )


def pivot_agreement(suite, tasks: list[Task], base: list[Trajectory], parsed) -> dict[str, float]:
    """How the valid reflections on failed episodes place their pivot against the suite's diagnostician
    (``reflection.diagnosis_of``): ``rollout/pivot_accuracy``, the share that names its pivot, and
    ``rollout/pivot_offset``, their pivot minus its pivot, mean (> 0: too late, the faulty turn is
    replayed and masked). Empty when the suite has no diagnostician or no such reflection exists
    (the tags then have a gap at this step)."""
    offsets = []
    for trajectory, task, (reflection, _) in zip(base, tasks, parsed):
        if reflection is None or trajectory.success or trajectory.reward_error:
            continue
        diagnosis = diagnosis_of(suite, task, trajectory)
        if diagnosis is None:
            return {}
        offsets.append(reflection.retry_from_step - diagnosis["retry_from_step"])
    if not offsets:
        return {}
    return {
        "rollout/pivot_accuracy": sum(offset == 0 for offset in offsets) / len(offsets),
        "rollout/pivot_offset": sum(offsets) / len(offsets),
    }


def success_label_agreement(suite, tasks: list[Task], base: list[Trajectory], parsed) -> dict[str, float]:
    """How the reflections on successful episodes (no reward error) label them against the suite's
    diagnostician: ``rollout/clean_success_share``, the share of those episodes it calls ``success``
    (every action on a shortest path; the others are ``success_but_inefficient``), the only episodes a
    correct judgment may call ``success`` (``rollout/success_judgment_samples`` counts every ``success``
    said of a maximum-reward episode, the reference's rule);
    ``rollout/success_label_accuracy``, the share of valid reflections on them whose label is the
    diagnostician's. Empty when the suite has no diagnostician or no such episode exists."""
    clean = labelled = agreed = 0
    successes = 0
    for trajectory, task, (reflection, _) in zip(base, tasks, parsed):
        if not trajectory.success or trajectory.reward_error:
            continue
        diagnosis = diagnosis_of(suite, task, trajectory)
        if diagnosis is None:
            return {}
        successes += 1
        clean += diagnosis["trajectory_outcome"] == "success"
        if reflection is not None and reflection.judged:
            labelled += 1
            agreed += reflection.trajectory_outcome == diagnosis["trajectory_outcome"]
    if not successes:
        return {}
    figures = {"rollout/clean_success_share": clean / successes}
    if labelled:
        figures["rollout/success_label_accuracy"] = agreed / labelled
    return figures


def r3l_metrics(base, parsed, retry_of: list[int], pivots: list[int], improved: int) -> dict[str, float]:
    invalid = sum(1 for reflection, _ in parsed if reflection is None)
    # Does the reflection's outcome match the environment's verdict? Both success labels count as
    # claiming success.
    judged = [(r.trajectory_outcome != "failure") == t.success for t, (r, _) in zip(base, parsed) if r is not None and r.judged]
    positions = [k / max(len(base[i].turns), 1) for i, k in zip(retry_of, pivots)]
    saved = sum(sum(len(t.response_ids) for t in base[i].turns[:k]) for i, k in zip(retry_of, pivots))
    # A retry from scratch would cost about what its base episode cost.
    from_scratch = sum(base[i].num_response_tokens for i in retry_of)
    return {
        "rollout/reflection_invalid_rate": invalid / max(len(parsed), 1),
        "rollout/reflection_outcome_agreement": sum(judged) / len(judged) if judged else 0.0,
        "rollout/retry_rate": len(retry_of) / max(len(base), 1),
        "rollout/retry_improvement_rate": improved / max(len(retry_of), 1),
        "rollout/pivot_position": sum(positions) / len(positions) if positions else 0.0,
        "rollout/retry_tokens_saved": float(saved),
        "rollout/retry_tokens_saved_share": saved / from_scratch if from_scratch else 0.0,
        "rollout/pivot_late_share": sum(k > 0 for k in pivots) / len(pivots) if pivots else 0.0,
    }
