"""The warm-start's producer: each warm-start step's demonstrations, all for the SFT head.

A demonstration comes from the suite's scripted expert (``TaskSuite.demonstration``, played through
the agent loop so its tokens are booked as a rollout's are), optionally with the suite's scripted
reflections and guided retries (``rollout/warmstart.py``), or from a chat JSONL file. What a step
holds is a pure function of its index, rank and seed, so a resumed warm-start continues exactly.
"""

from __future__ import annotations

import collections
import os
import random
from dataclasses import dataclass
from typing import Optional

from r3lightning.envs.base import Task, TaskSuite
from r3lightning.envs.jsonl import numbered_jsonl_rows
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.rollout.explorers.reflection import Reflector
from r3lightning.rollout.warmstart import scripted_reflection_samples
from r3lightning.types import Trajectory, Turn

KEY = "model.phases.warmstart.demos"
"""Where ``DemoConfig`` sits in ``r3l``'s config (error messages name its keys so)."""


@dataclass
class DemoConfig:
    """Where the warm-start's demonstrations come from and what they hold.

    Args:
        source: ``suite`` (the environment's scripted expert, ``TaskSuite.demonstration``) or the path of
            a JSONL file whose rows hold ``messages``: a chat conversation (system/user/assistant).
        reflections: also train on the suite's scripted reflections and guided retries (R³L
            warm-start: needs a suite with ``diagnose``/``expert_continuation`` and an explorer that
            reflects, whose prompt templates are used).
        tasks_per_step: demonstrations per warm-start step on each rank (0: ``data.tasks_per_step``).
            SFT steps cost no generation, so they can afford larger batches than RL steps.
        reflection_tasks_per_step: with ``reflections``, how many of a step's demonstration tasks also
            give a reflect and a retry sample (0: all). Reflections are long JSON answers after long
            prompts; fewer of them keeps the step cheap and leaves the action tokens most of the loss.
        success_reflection_share: with ``reflections``, the share of reflection tasks played by the
            expert without a mistake, whose reflection judges ``success`` (no retry). Every other
            reflection sample has an injected mistake, so at 0 the policy never learns to call an
            episode a success: R³L then retries every episode and ``train_success_judgments`` has
            nothing to train. It also changes when a tiny policy learns to act on the goal during the
            warm-start, so a recipe can teach it late (``success_reflection_from_step``). The runs
            behind the recipes' shares: benchmarks/results/NOTEBOOK.md.
        success_reflection_from_step: the warm-start step from which ``success_reflection_share``
            applies (0: from the first). The steps before it play no clean episode and are exactly a
            share-0 run's steps (the same random stream), so the policy learns to act first and to
            judge success after.
        alternative_guidance_share: with ``reflections``, the share of guided-retry samples whose
            guidance names a random other admissible action at the pivot instead of the expert's, the
            retry taking it and the expert continuing after it. The expert's own suggestion names the
            action the observation already implies, so the policy can fit every retry sample without
            reading the guidance, and then ignores it (measured: benchmarks/results/NOTEBOOK.md, "The
            oracle arm" and "The guidance probe"). Logged
            per warm-start step: ``warmstart/alternative_guidance_samples`` and, for draws that fell
            back to the expert's suggestion, ``warmstart/alternative_guidance_unavailable``. 0 keeps
            the expert's suggestion everywhere.
    """

    source: str = "suite"
    reflections: bool = False
    tasks_per_step: int = 0
    reflection_tasks_per_step: int = 0
    success_reflection_share: float = 0.0
    success_reflection_from_step: int = 0
    alternative_guidance_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("success_reflection_share", "alternative_guidance_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{KEY}.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.success_reflection_from_step < 0:
            raise ValueError(f"{KEY}.success_reflection_from_step must be >= 0, got {self.success_reflection_from_step}")

    def success_share_at(self, step: int) -> float:
        """The share of clean success episodes among the reflection tasks of warm-start ``step``."""
        return self.success_reflection_share if step >= self.success_reflection_from_step else 0.0


class Demonstrations:
    """Turns a warm-start step's task batch into SFT samples (``samples``), as ``config`` says.

    ``loop``: the agent loop that plays the suite's expert (None for a file); ``reflector``: the
    templates of scripted reflections; ``tasks_per_step``: the demonstrations per step of a file when
    ``config.tasks_per_step`` is 0. A file is read here, so a bad row stops the run before training.
    """

    def __init__(self, config: DemoConfig, suite: TaskSuite, loop: Optional[AgentLoop], reflector: Reflector, tokenizer,
                 tasks_per_step: int) -> None:
        self.config, self.suite, self.loop, self.reflector = config, suite, loop, reflector
        self.tokenizer, self.tasks_per_step = tokenizer, tasks_per_step
        self.rows = load_chat_jsonl(config.source) if config.source != "suite" else None

    def samples(self, step: int, tasks: list[Task], rank: int, world: int, seed: int) -> Exploration:
        """Step ``step``'s demonstrations on ``rank`` of ``world`` (``tasks``: the step's task batch;
        ``seed``: of the scripted reflections' draws), with the step's ``warmstart/`` figures."""
        failures = self.loop.env_calls.failures if self.loop is not None else 0
        counts: collections.Counter = collections.Counter()
        if self.rows is None:
            demos = self._from_suite(step, tasks, rank, world, seed, counts)
        else:
            demos = self._from_file(step, rank, world)
        # Scripted retry samples whose prefix the environment could not replay are dropped, and counted.
        kept = [d for d in demos if d.end_reason != "replay_failed"]
        metrics = {"warmstart/replay_failures": float(len(demos) - len(kept))}
        if self.config.alternative_guidance_share > 0:
            metrics["warmstart/alternative_guidance_samples"] = float(counts["alternative_guidance"])
            metrics["warmstart/alternative_guidance_unavailable"] = float(counts["alternative_unavailable"])
        if self.loop is not None:
            metrics["warmstart/env_call_errors"] = float(self.loop.env_calls.failures - failures)
        return Exploration(groups=[], sft=kept, metrics=metrics)

    def _tasks(self, step: int, tasks: list[Task], rank: int, world: int) -> list[Task]:
        n = self.config.tasks_per_step
        if n <= 0 or n == len(tasks):
            return tasks
        first = (step * world + rank) * n
        return [self.suite.train_task(first + j) for j in range(n)]

    def _from_suite(self, step: int, tasks: list[Task], rank: int, world: int, seed: int,
                    counts: collections.Counter) -> list[Trajectory]:
        tasks = self._tasks(step, tasks, rank, world)
        actions = [self.suite.demonstration(task) for task in tasks]
        missing = [t.task_id for t, a in zip(tasks, actions) if not a]
        if missing:
            raise ValueError(
                f"{KEY}.source=suite: {type(self.suite).__name__} has no demonstration for task {missing[0]!r}; "
                "give a JSONL file of demonstrations instead"
            )
        name = type(self.suite).__name__
        demos = self.loop.play_actions(
            [EpisodeRequest(task=t, origin="demo") for t in tasks], actions, source=f"data.suite {name}.demonstration",
            fix=(
                f"the warm-start ({KEY}.source=suite) trains whole episodes: make {name}.demonstration return every "
                f"action up to the episode's end, or give {KEY}.source a JSONL file of demonstrations"
            ),
        )
        if self.config.reflections:
            n = self.config.reflection_tasks_per_step
            chosen = tasks[:n] if n > 0 else tasks
            demos += scripted_reflection_samples(
                self.loop, self.reflector, chosen, random.Random(seed), self.config.success_share_at(step),
                self.config.alternative_guidance_share, counts,
            )
        return demos

    def _from_file(self, step: int, rank: int, world: int) -> list[Trajectory]:
        rows = self.rows
        n = self.config.tasks_per_step if self.config.tasks_per_step > 0 else self.tasks_per_step
        start = (step * world + rank) * n
        return [
            conversation_trajectory(rows[(start + j) % len(rows)], self.tokenizer, f"demo-{(start + j) % len(rows)}")
            for j in range(n)
        ]


def load_chat_jsonl(path: str) -> list[list[dict]]:
    """Rows of ``{"messages": [{"role", "content"}, ...]}``; errors name the file, row and field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{KEY}.source: no such file {path!r}")
    rows = []
    for number, row in numbered_jsonl_rows(path):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}, row {number}: field 'messages' (a non-empty list) is missing")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"{path}, row {number}: field 'messages' has an entry without a valid role/content")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path}, row {number}: field 'messages' has no assistant message to train on")
        check_role_order([m["role"] for m in messages], f"{path}, row {number}")
        rows.append(messages)
    if not rows:
        raise ValueError(f"{KEY}.source: {path!r} has no rows")
    return rows


def check_role_order(roles: list[str], where: str) -> None:
    """An optional system message first, then user and assistant messages alternating, starting with a
    user message (two user messages in a row would silently lose the first)."""
    body = roles[1:] if roles[:1] == ["system"] else roles
    for position, role in enumerate(body):
        expected = "user" if position % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(
                f"{where}: message {position + 1 + (len(roles) - len(body))} is {role!r} where {expected!r} was expected "
                "(messages: an optional system message, then user and assistant alternating)"
            )


def conversation_trajectory(messages: list[dict], tokenizer, task_id: str, origin: str = "demo") -> Trajectory:
    """Tokenize a finished chat conversation into turns, incrementally (same scheme as the agent loop)."""
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    chat = ChatFormatter(tokenizer, system_prompt=system)
    turns: list[Turn] = []
    pending: Optional[list[int]] = None
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "user":
            text = m["content"]
            pending = chat.first_prompt(text) if not turns else chat.next_user_turn(text, previous_ended_with_eos=True)
        else:
            if pending is None:
                raise ValueError(f"demonstration {task_id}: an assistant message must follow a user message")
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            turns.append(Turn(context_ids=pending, response_ids=ids, action=m["content"]))
            pending = None
    return Trajectory(task_id=task_id, turns=turns, reward=1.0, success=True, origin=origin)
