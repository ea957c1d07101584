"""Scripted warm-start data for reflection: a suite's diagnostician writes what the policy should.

Procedural worlds know their optimal plan, so they can show the policy, before RL, what a good
reflection on a flawed episode looks like (reflect samples) and how to continue from the pivot under
its guidance (retry samples). The same material seeds the in-memory tokenizer's corpus.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
from typing import Optional

from r3lightning.envs.base import Task, TaskSuite
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.env_calls import EnvCallError, SuiteCalls
from r3lightning.rollout.explorers.reflection import Reflector, diagnosis_of, standalone_prompts, target_tokens
from r3lightning.types import Trajectory, Turn


def reflection_corpus(suite, reflector: Reflector, num_tasks: int = 64, step_timeout_s: Optional[float] = 30.0) -> list[str]:
    """Texts of the reflector's prompts and, when the suite has a diagnostician, example reflections,
    so a tokenizer trained in memory encodes reflections compactly. The environment calls have the
    deadline ``step_timeout_s`` (``agent.step_timeout_s``); one that fails raises ``EnvCallError``."""
    texts = [reflector.reflection_template, reflector.guidance_template]
    if type(suite).diagnose is TaskSuite.diagnose:
        return texts  # no diagnostician: no example reflections (and no environment to play)
    calls = SuiteCalls(suite, step_timeout_s, "data.suite: building the tokenizer's corpus (example reflections)")
    rng = random.Random(0)
    for index in range(num_tasks):
        task = suite.train_task(index)
        plan = suite.demonstration(task) or []
        # An inefficient success, then a failure with a mistake at a random step: the failure
        # wording ("failed", the root causes) must be in the vocabulary as much as the success's.
        step = rng.randrange(max(len(plan), 1))
        flawed = plan[:step] + [_wrong_action(calls, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
        for actions in (["look", *plan], flawed):
            diagnosis = suite.diagnose(task, actions)
            if diagnosis is None:
                return texts
            texts.extend([json.dumps(diagnosis), reflector.guidance(diagnosis)])
    return texts


def scripted_reflection_samples(
    loop: AgentLoop, reflector: Reflector, tasks: list[Task], rng: random.Random, success_share: float = 0.0,
    alternative_share: float = 0.0, counts: Optional[collections.Counter] = None,
) -> list[Trajectory]:
    """Warm-start SFT data from a suite's scripted diagnostician (procedural worlds have one).

    For each task: the expert plan with one injected mistake (a random admissible action at a random
    step), continued like the policy's own episodes are: half the time by the expert's recovery (a
    success, often an inefficient one), half the time by random admissible actions until the episode
    ends; the diagnostician's reflection of it (reflect sample), and the expert's continuation from
    the pivot under the guidance (retry sample). With probability ``success_share`` a task is played
    by the expert plan as it is instead: its reflection judges ``success`` and has no retry. Without
    such samples the policy never learns to judge an episode ``success``.

    With probability ``alternative_share`` a retry sample's guidance names another admissible action
    at the pivot instead of the expert's (``_alternative_guidance``), and the retry takes it before the
    expert continues. The diagnostician's guidance names the action the observation already implies, so
    a policy can fit those retries without reading the guidance, and then ignores it in RL (benchmarks/results/NOTEBOOK.md,
    "The oracle arm"); an alternative can only be predicted from the guidance. ``counts`` (when given)
    gets ``alternative_guidance`` for every such sample and ``alternative_unavailable`` for every draw
    that fell back to the expert's guidance (no other admissible action, or none the expert can finish
    from within the turn budget).
    """
    suite = loop.suite
    samples: list[Trajectory] = []
    played_tasks, played_actions = [], []
    for task in tasks:
        plan = suite.demonstration(task) or []
        # Drawn only when asked for, so that runs without clean episodes keep their random stream.
        if success_share > 0 and plan and rng.random() < success_share:
            played_tasks.append(task)
            played_actions.append(list(plan))
            continue
        step = rng.randrange(max(len(plan), 1))
        try:
            actions = plan[:step] + [_wrong_action(loop.env_calls, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
            if rng.random() < 0.5:
                actions += suite.expert_continuation(task, actions) or []
            else:
                actions += _random_actions(loop.env_calls, task, actions, len(plan) + 2, rng)
        except EnvCallError:
            continue  # the environment failed while the mistake was chosen: no sample of this task (loop.env_calls counts it)
        played_tasks.append(task)
        played_actions.append(actions)
    tasks = played_tasks
    played = loop.play_actions([EpisodeRequest(task=t) for t in tasks], played_actions, allow_unfinished=True)
    retry_requests, retry_actions = [], []
    for task, traj in zip(tasks, played):
        diagnosis = diagnosis_of(suite, task, traj)
        if diagnosis is None:
            continue
        k = diagnosis["retry_from_step"]
        [prompt] = standalone_prompts(loop, [reflector.prompt(traj, loop)])
        [answer] = target_tokens(loop.tokenizer, [json.dumps(diagnosis)])
        samples.append(Trajectory(task.task_id, [Turn(context_ids=prompt, response_ids=answer)], 1.0, True, origin="reflect_sft"))
        continuation = suite.expert_continuation(task, traj.actions[:k])
        if diagnosis["trajectory_outcome"] != "success" and continuation:
            # Drawn only when asked for, so that runs without the option keep their random stream.
            if alternative_share > 0 and rng.random() < alternative_share:
                alternative = _alternative_guidance(loop, task, traj.actions[:k], diagnosis, continuation[0], rng)
                if alternative is not None:
                    diagnosis, continuation = alternative
                if counts is not None:
                    counts["alternative_unavailable" if alternative is None else "alternative_guidance"] += 1
            retry_requests.append(EpisodeRequest(task=task, prefix=traj.turns[:k], guidance=reflector.guidance(diagnosis)))
            retry_actions.append(continuation)
    if not retry_requests:
        return samples
    name = type(suite).__name__
    retries = loop.play_actions(
        retry_requests, retry_actions, source=f"data.suite {name}.expert_continuation",
        fix=f"scripted reflection retries play the expert to the episode's end: make {name}.expert_continuation return every action up to it",
    )
    for request, traj in zip(retry_requests, retries):
        k = len(request.prefix)
        turns = [dataclasses.replace(t, trainable=False) for t in traj.turns[:k]] + list(traj.turns[k:])
        samples.append(dataclasses.replace(traj, turns=turns, origin="retry_sft", info={}))
    return samples


def _alternative_guidance(
    loop: AgentLoop, task: Task, prefix: list[str], diagnosis: dict, expert_action: str, rng: random.Random
) -> Optional[tuple[dict, list[str]]]:
    """(the diagnosis with its suggestion naming a random other admissible action after ``prefix`` in
    place of ``expert_action``, that action followed by the expert's continuation from it), or None
    when the suggestion does not quote ``expert_action``, no other action is admissible, or the
    expert cannot finish from it within the turn budget."""
    quoted = f"'{expert_action}'"
    if quoted not in diagnosis["improvement_suggestion"]:
        return None
    try:
        _, admissible, _ = _replayed(loop.env_calls, task, prefix)
    except EnvCallError:
        return None
    choices = [a for a in admissible if a != expert_action]
    if not choices:
        return None
    action = rng.choice(choices)
    rest = loop.suite.expert_continuation(task, prefix + [action])
    if not rest or len(prefix) + 1 + len(rest) > loop.suite.max_turns:
        return None
    suggestion = diagnosis["improvement_suggestion"].replace(quoted, f"'{action}'", 1)
    return {**diagnosis, "improvement_suggestion": suggestion}, [action, *rest]


def _replayed(calls: SuiteCalls, task: Task, prefix: list[str]):
    """(environment reset to ``task`` with ``prefix`` played, admissible actions after it, episode over);
    ``EnvCallError`` when a call fails (``calls``: the deadline and checks of the agent loop)."""
    env = calls.suite.make_env()
    calls.reset(env, task)
    result = None
    for action in prefix:
        result = calls.step(env, task, action)
    admissible = list(result.info.get("admissible_actions", [])) if result is not None else []
    return env, admissible, result is not None and result.done


def _random_actions(calls: SuiteCalls, task: Task, prefix: list[str], count: int, rng: random.Random) -> list[str]:
    """Up to ``count`` random admissible actions played after ``prefix`` (fewer when the episode ends)."""
    env, admissible, done = _replayed(calls, task, prefix)
    actions: list[str] = []
    while len(actions) < count and admissible and not done:
        actions.append(rng.choice(admissible))
        result = calls.step(env, task, actions[-1])
        admissible, done = list(result.info.get("admissible_actions", [])), result.done
    return actions


def _wrong_action(calls: SuiteCalls, task: Task, prefix: list[str], correct: Optional[str], rng: random.Random) -> str:
    _, admissible, _ = _replayed(calls, task, prefix)
    if not admissible:
        _, admissible, _ = _replayed(calls, task, ["look"])
    choices = [a for a in admissible if a != correct] or ["look"]
    return rng.choice(choices)
