"""The in-context setup check budgets the feedback the suite writes (issue 62; science review of
2026-12-07 §2: it budgeted ``(no feedback)``, 7 tokens, for feedback the environment writes in 15-28,
so at a context of 100 the check passed and in-context episodes were cut after 3 tokens or never began)."""

import re

import pytest
from harness import ARITHMETIC, suite_tokenizer
from scripted_engine import ScriptedEngine

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer, attempt_text
from r3lightning.types import Trajectory, Turn

MAX_NEW = 8


def _connected(limit: int) -> tuple[RolloutDataModule, object]:
    suite = MathSuite(**ARITHMETIC)
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=limit)
    tokenizer = suite_tokenizer(suite, 8, agent)
    data = RolloutDataModule(suite, explorer=InContextReflectionExplorer(), group_size=2, tasks_per_step=2,
                             sampling=SamplingParams(max_new_tokens=MAX_NEW), agent=agent)
    data.check_prompt_room = lambda: None  # connect first, check below at chosen limits
    data.connect(ScriptedEngine(tokenizer, lambda prompt: "7"), tokenizer, AlgorithmConfig(policy_loss="pg"))
    del data.check_prompt_room
    return data, tokenizer


def test_every_feedback_the_math_environment_writes_is_declared():
    suite = MathSuite(**ARITHMETIC)
    task = suite.train_task(0)
    written = set()
    for action in ("no answer here", "\\boxed{}", f"\\boxed{{{int(task.answer) + 1}}}"):
        env = suite.make_env()
        env.reset(task)
        written.add(env.step(action).feedback)
    assert written <= set(suite.feedback_texts())


def test_the_check_refuses_a_context_an_in_context_episode_with_the_longest_feedback_would_overflow():
    data, tokenizer = _connected(10_000)
    longest = data.longest_feedback()
    assert longest == "No final answer found; put it in \\boxed{}."  # 28 tokens with the recipe's tokenizer kind
    explorer, chat = data.explorer, data.connected_loop.chat
    # A past unreadable answer of the full budget, with the feedback the environment gave it.
    answer = tokenizer("7 " * 40, add_special_tokens=False)["input_ids"][:MAX_NEW]
    failure = Trajectory("t", [Turn([], answer, feedback=longest)])
    tasks = [data.suite.train_task(i) for i in range(8)] + data.suite.val_tasks()[:8]

    def in_context_prompt(task: Task) -> int:
        guidance = explorer.template.format(attempt=attempt_text(failure, tokenizer)).strip()
        return len(chat.first_prompt(data.agent.guidance_template.format(observation=task.prompt, guidance=guidance)))

    room = max(in_context_prompt(t) for t in tasks) + MAX_NEW  # that prompt and a full new answer
    data.agent = AgentLoopConfig(action_format="raw", max_context_tokens=room - 1)
    with pytest.raises(ValueError, match=r"need (\d+), more than data.agent.max_context_tokens") as refused:
        data.check_prompt_room()
    need = int(re.search(r"need (\d+)", str(refused.value)).group(1))
    assert need >= room
    data.agent = AgentLoopConfig(action_format="raw", max_context_tokens=need)
    data.check_prompt_room()
