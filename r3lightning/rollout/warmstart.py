"""Scripted warm-start data for reflection: a suite's diagnostician writes what the policy should.

Procedural worlds know their optimal plan, so they can show the policy, before RL, what a good
reflection on a flawed episode looks like (reflect samples) and how to continue from the pivot under
its guidance (retry samples). The same material seeds the in-memory tokenizer's corpus.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Optional

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.reflection import Reflector, diagnosis_of, standalone_prompts, target_tokens
from r3lightning.types import Trajectory, Turn


def reflection_corpus(suite, reflector: Reflector, num_tasks: int = 64) -> list[str]:
    """Texts of the reflector's prompts and, when the suite has a diagnostician, example reflections,
    so a tokenizer trained in memory encodes reflections compactly."""
    texts = [reflector.reflection_template, reflector.guidance_template]
    rng = random.Random(0)
    for index in range(num_tasks):
        task = suite.train_task(index)
        plan = suite.demonstration(task) or []
        # An inefficient success, then a failure with a mistake at a random step: the failure
        # wording ("failed", the root causes) must be in the vocabulary as much as the success's.
        step = rng.randrange(max(len(plan), 1))
        flawed = plan[:step] + [_wrong_action(suite, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
        for actions in (["look", *plan], flawed):
            diagnosis = suite.diagnose(task, actions)
            if diagnosis is None:
                return texts
            texts.extend([json.dumps(diagnosis), reflector.guidance(diagnosis)])
    return texts


def scripted_reflection_samples(
    loop: AgentLoop, reflector: Reflector, tasks: list[Task], rng: random.Random, success_share: float = 0.0
) -> list[Trajectory]:
    """Warm-start SFT data from a suite's scripted diagnostician (procedural worlds have one).

    For each task: the expert plan with one injected mistake (a random admissible action at a random
    step), continued like the policy's own episodes are: half the time by the expert's recovery (a
    success, often an inefficient one), half the time by random admissible actions until the episode
    ends; the diagnostician's reflection of it (reflect sample), and the expert's continuation from
    the pivot under the guidance (retry sample). With probability ``success_share`` a task is played
    by the expert plan as it is instead: its reflection judges ``success`` and has no retry. Without
    such samples the policy never learns to judge an episode ``success``.
    """
    suite = loop.suite
    samples: list[Trajectory] = []
    played_actions = []
    for task in tasks:
        plan = suite.demonstration(task) or []
        # Drawn only when asked for, so that runs without clean episodes keep their random stream.
        if success_share > 0 and plan and rng.random() < success_share:
            played_actions.append(list(plan))
            continue
        step = rng.randrange(max(len(plan), 1))
        actions = plan[:step] + [_wrong_action(suite, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
        if rng.random() < 0.5:
            actions += suite.expert_continuation(task, actions) or []
        else:
            actions += _random_actions(suite, task, actions, len(plan) + 2, rng)
        played_actions.append(actions)
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
            retry_requests.append(EpisodeRequest(task=task, prefix=traj.turns[:k], guidance=reflector.guidance(diagnosis)))
            retry_actions.append(continuation)
    if not retry_requests:
        return samples
    retries = loop.play_actions(retry_requests, retry_actions)
    for request, traj in zip(retry_requests, retries):
        k = len(request.prefix)
        turns = [dataclasses.replace(t, trainable=False) for t in traj.turns[:k]] + list(traj.turns[k:])
        samples.append(dataclasses.replace(traj, turns=turns, origin="retry_sft", info={}))
    return samples


def _replayed(suite, task: Task, prefix: list[str]):
    """(environment reset to ``task`` with ``prefix`` played, admissible actions after it, episode over)."""
    env = suite.make_env()
    env.reset(task)
    result = None
    for action in prefix:
        result = env.step(action)
    admissible = list(result.info.get("admissible_actions", [])) if result is not None else []
    return env, admissible, result is not None and result.done


def _random_actions(suite, task: Task, prefix: list[str], count: int, rng: random.Random) -> list[str]:
    """Up to ``count`` random admissible actions played after ``prefix`` (fewer when the episode ends)."""
    env, admissible, done = _replayed(suite, task, prefix)
    actions: list[str] = []
    while len(actions) < count and admissible and not done:
        actions.append(rng.choice(admissible))
        result = env.step(actions[-1])
        admissible, done = list(result.info.get("admissible_actions", [])), result.done
    return actions


def _wrong_action(suite, task: Task, prefix: list[str], correct: Optional[str], rng: random.Random) -> str:
    _, admissible, _ = _replayed(suite, task, prefix)
    if not admissible:
        _, admissible, _ = _replayed(suite, task, ["look"])
    choices = [a for a in admissible if a != correct] or ["look"]
    return rng.choice(choices)
