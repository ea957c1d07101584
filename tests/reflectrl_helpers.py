"""Small ReflectRL material shared by its tests: an expert's rollouts on arithmetic, written as a pool.

Importable as ``reflectrl_helpers`` (pytest's ``pythonpath`` includes ``tests/``).
"""

from __future__ import annotations

from harness import ARITHMETIC

from r3lightning.data.reflectrl.gnt_pool import PoolStats, build_pool, write_jsonl
from r3lightning.envs.math_env import MathSuite


def arithmetic_suite(**overrides) -> MathSuite:
    """Single-turn arithmetic with the bare question as prompt (4 validation tasks)."""
    return MathSuite(**{**ARITHMETIC, **overrides})


def rollout_row(task, split: str, index, response: str, sample: int = 0) -> dict:
    return {
        "task_id": task.task_id, "split": split, "index": index, "question": task.data["question"],
        "prompt": task.prompt, "answer": task.answer, "response": response,
        "expert": "scripted", "engine": "none", "sampling": {}, "sample": sample, "source": "generated",
    }


def expert_rows(suite, num_train: int = 8) -> list[dict]:
    """Two answers per task: a right one (``\\boxed{answer}``) and a wrong one (``\\boxed{answer+1}``),
    for training tasks 0..num_train-1 and every validation task."""
    rows = []
    tasks = [("train", i, suite.train_task(i)) for i in range(num_train)] + [("val", i, t) for i, t in enumerate(suite.val_tasks())]
    for split, index, task in tasks:
        rows.append(rollout_row(task, split, index, f"\\boxed{{{task.answer}}}", 0))
        rows.append(rollout_row(task, split, index, f"{task.data['question'][8:-1]}={int(task.answer) + 1}\n\\boxed{{{int(task.answer) + 1}}}", 1))
    return rows


def write_pool(path, suite, num_train: int = 8) -> list[dict]:
    """Verify and label ``expert_rows`` on ``suite`` and write them to ``path``; returns the pool rows."""
    pool, _ = build_pool(expert_rows(suite, num_train), suite, PoolStats())
    write_jsonl(str(path), pool)
    return pool
