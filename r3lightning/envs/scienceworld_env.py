"""ScienceWorld (the ``scienceworld`` package) as a ``TaskSuite`` (docs/environments.md).

ScienceWorld is a Scala simulator of elementary-school science tasks (30 tasks, e.g. ``boil``,
``find-living-thing``, ``test-conductivity``), each with numbered variations that the package splits
into train, dev and test sets. The simulator runs in a JVM started by the package (``py4j``), so Java
must be installed (``apt-get install default-jre``); the jar ships inside the package, nothing is
downloaded.

A task is (task name, variation). The first observation is the task description and the output of
``look around``; later observations are the simulator's answer to the action. The simulator scores
progress from 0 to 100 and reports -100 when the task became impossible (e.g. focusing on the wrong
object), which ends the episode. Reward: the current score / 100, negatives clipped to 0, so it is the
episode's reward so far in [0, 1]. Success: the task is completed (score 100). The episode ends on
completion, on failure or after ``max_turns`` steps (30, as in the R³L paper).

Valid actions: listing them (``list_valid_actions``) costs a simulator call per step (about 0.2 s)
and hundreds of entries (400+ in a typical room), so it is off by default; the system prompt lists the
action templates instead. When on, the observation ends with ``Valid actions: ...`` and
``info["admissible_actions"]`` holds the list.

Cost: a JVM takes about 2 s to start and 200-700 MB of memory; loading a task takes 0.1-2 s; a step
about 20 ms (steps call the simulator directly: the package's ``step`` also fetches the valid actions,
the room and the inventory every time, 0.1-0.8 s). Environments lease JVMs from the suite's pool (one per concurrent episode) and give
them back when the episode ends, so later batches reuse them. Variation lists are read from the
simulator on first use (about 4 s for all 30 tasks).

Demonstrations: the simulator's gold action sequence for the variation (computed on load with
``generateGoldPath``; cached). Some gold sequences are longer than ``max_turns`` (``boil`` variation 0
takes 39 actions).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Hashable
from functools import cached_property
from typing import Any, Literal, Optional

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.common import SimulatorPool, attach_lease, finite_index, import_optional, valid_actions_line

JAVA_HINT = (
    "ScienceWorld runs in a Java virtual machine, but no `java` executable was found on PATH. "
    "Install a Java runtime (version 8 or newer), e.g. `apt-get install default-jre` on Debian/Ubuntu, "
    "`conda install -c conda-forge openjdk` or `brew install openjdk`, and make sure `java -version` works."
)
ACTION_TEMPLATES = (
    "look around, look at OBJ, look in OBJ, inventory, task, go to LOCATION, open OBJ, close OBJ, "
    "pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ in OBJ, dunk OBJ in OBJ, mix OBJ, focus on OBJ, "
    "activate OBJ, deactivate OBJ, use OBJ on OBJ, connect OBJ to OBJ, disconnect OBJ, eat OBJ, flush OBJ, "
    "read OBJ, wait, wait1"
)
DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a simulated science lab and its surroundings. Complete the task stated in the "
    "first message. Each turn, reply with exactly one action inside <action>...</action>, for example "
    "<action>look around</action>. Action templates (OBJ and LOCATION are names you have seen): "
    f"{ACTION_TEMPLATES}. Focus only on the object the task asks about: focusing on a wrong one fails the task."
)
INVALID_ANSWERS = ("No known action matches that input.",)


def require_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise RuntimeError(JAVA_HINT)
    return java


def all_task_names() -> list[str]:
    """The 30 ScienceWorld task names, from the package's task table (no JVM needed)."""
    constants = import_optional("scienceworld.constants", "ScienceWorld")
    return sorted({task["task_name"] for task in constants.TASKS})


def _start_simulator(_: Hashable) -> Any:
    require_java()
    scienceworld = import_optional("scienceworld", "ScienceWorld")
    sim = scienceworld.ScienceWorldEnv("", envStepLimit=10**9)
    sim.r3l_loaded = None  # (task name, variation, simplification) currently loaded
    return sim


def _close_simulator(sim: Any) -> None:
    sim.close()


def load_task(sim: Any, name: str, variation: int, simplification: str, gold: bool = False) -> None:
    """Load (or, when it is already loaded, reset) a task variation; the gold path only on request."""
    key = (name, variation, simplification)
    if gold or sim.r3l_loaded != key:
        sim.load(name, variation, simplification, generateGoldPath=gold)
        sim.r3l_loaded = key
    sim.server.reset()


class ScienceWorldEnv:
    """One ScienceWorld episode at a time (see the module docstring)."""

    def __init__(self, suite: "ScienceWorldSuite") -> None:
        self.suite = suite
        self.max_turns = suite.max_turns
        self._lease = attach_lease(self, suite.pool)
        self._turns = 0
        self._done = True
        self._valid: list[str] = []

    def _refresh_valid(self) -> None:
        if self.suite.list_valid_actions:
            self._valid = sorted(set(self._lease.sim.get_valid_action_object_combinations()))

    def _with_actions(self, text: str) -> str:
        if not self.suite.list_valid_actions:
            return text
        return f"{text}\n{valid_actions_line(self._valid)}"

    def reset(self, task: Task) -> str:
        sim = self._lease.acquire(None)
        load_task(sim, task.data["task_name"], int(task.data["variation"]), self.suite.simplification)
        look = sim.server.step("look around")
        description = sim.server.freeActionTaskDesc()
        self._turns, self._done = 0, False
        self._refresh_valid()
        return self._with_actions(f"{description.strip()}\n\n{look.strip()}")

    def step(self, action: str) -> StepResult:
        if self._done or self._lease.sim is None:
            raise RuntimeError("ScienceWorldEnv.step called before reset or after the episode ended")
        sim = self._lease.sim
        command = " ".join(action.split())
        self._lease.busy = True
        answer = sim.server.step(command)
        score = int(round(100 * sim.server.getScore()))
        completed = bool(sim.server.getCompleted())
        self._lease.busy = False
        self._turns += 1
        success = completed and score >= 100
        failed = score < 0
        self._done = completed or failed or self._turns >= self.max_turns
        feedback = answer.strip()
        invalid = feedback in INVALID_ANSWERS or not command
        if self._done:
            self._valid = []
            self._lease.release()
            if success:
                text = f"{feedback}\nTask complete."
            elif failed:
                text = f"{feedback}\nThe task failed."
            else:
                text = f"{feedback}\nYou have run out of turns."
        else:
            self._lease.busy = True
            self._refresh_valid()
            self._lease.busy = False
            text = self._with_actions(feedback)
        info = {"feedback": feedback, "success": success, "admissible_actions": list(self._valid),
                "invalid_action": invalid, "score": score}
        reward = min(max(score, 0), 100) / 100.0
        return StepResult(observation=text, reward=reward, done=self._done, info=info)


class ScienceWorldSuite(TaskSuite):
    """ScienceWorld task variations; the package's train/dev/test variation splits."""

    def __init__(
        self,
        task_names: Optional[list[str]] = None,
        val_split: Literal["dev", "test"] = "dev",
        num_val_per_task: Optional[int] = 2,
        max_turns: int = 30,
        list_valid_actions: bool = False,
        simplification: str = "",
        seed: int = 0,
        max_idle_simulators: int = 16,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        """
        Args:
            task_names: ScienceWorld task names (see ``all_task_names()``); default all 30.
            val_split: the package's variation split used for validation (training uses ``train``).
            num_val_per_task: validation variations per task (the first ones of ``val_split``); None: all.
            max_turns: episode step limit (30 as in the R³L paper).
            list_valid_actions: list the valid actions in every observation (slow and long; see the
                module docstring).
            simplification: ScienceWorld simplifications, comma-separated (``easy``, ``teleportAction``,
                ``openDoors``, ...); empty for none.
            seed: seed of the per-epoch shuffle of training variations.
            max_idle_simulators: JVMs kept running between episodes.
            system_prompt: system message of every conversation.
        """
        import_optional("scienceworld", "ScienceWorld")
        require_java()
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if val_split not in ("dev", "test"):
            raise ValueError(f"val_split must be 'dev' or 'test', got {val_split!r}")
        known = all_task_names()
        names = list(task_names) if task_names else known
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"unknown ScienceWorld tasks {unknown}; known: {known}")
        self.task_names = names
        self.val_split = val_split
        self.num_val_per_task = num_val_per_task
        self.max_turns = max_turns
        self.list_valid_actions = list_valid_actions
        self.simplification = simplification
        self.seed = seed
        self.system_prompt = system_prompt
        self.pool = SimulatorPool(_start_simulator, _close_simulator, max_idle=max_idle_simulators)
        self._lock = threading.Lock()
        self._gold: dict[tuple[str, int, str], Optional[tuple[str, ...]]] = {}

    # -- variations

    @cached_property
    def variations(self) -> dict[str, dict[str, list[int]]]:
        """``{task name: {"train"|"dev"|"test": [variation, ...]}}``, read from the simulator once."""
        sim = self.pool.acquire(None)
        try:
            out = {}
            for name in self.task_names:
                load_task(sim, name, 0, "")
                out[name] = {"train": list(sim.get_variations_train()), "dev": list(sim.get_variations_dev()),
                             "test": list(sim.get_variations_test())}
            return out
        finally:
            self.pool.release(None, sim)

    @cached_property
    def _train_items(self) -> list[tuple[str, int]]:
        return [(name, v) for name in self.task_names for v in self.variations[name]["train"]]

    def _task(self, name: str, variation: int, split: str) -> Task:
        return Task(task_id=f"scienceworld:{name}:{variation}", prompt=f"ScienceWorld task {name}, variation {variation}",
                    data={"task_name": name, "variation": variation, "split": split})

    def train_task(self, index: int) -> Task:
        items = self._train_items
        name, variation = items[finite_index(self.seed, index, len(items))]
        return self._task(name, variation, "train")

    def val_tasks(self) -> list[Task]:
        tasks = []
        for name in self.task_names:
            chosen = self.variations[name][self.val_split]
            if self.num_val_per_task is not None:
                chosen = chosen[: self.num_val_per_task]
            tasks += [self._task(name, v, self.val_split) for v in chosen]
        return tasks

    # -- environment and expert

    def make_env(self) -> ScienceWorldEnv:
        return ScienceWorldEnv(self)

    def demonstration(self, task: Task) -> Optional[list[str]]:
        key = (task.data["task_name"], int(task.data["variation"]), self.simplification)
        with self._lock:
            if key not in self._gold:
                sim = self.pool.acquire(None)
                try:
                    load_task(sim, *key, gold=True)
                    gold = [a for a in sim.get_gold_action_sequence() if not a.startswith("ERROR")]
                    self._gold[key] = tuple(gold) if gold else None
                finally:
                    sim.r3l_loaded = None  # force a plain reload next time (the gold load is slower)
                    self.pool.release(None, sim)
        gold = self._gold[key]
        return None if gold is None else list(gold)

    def close(self) -> None:
        """Stop the idle JVMs (they also stop when the process exits)."""
        self.pool.close()


__all__ = ["ScienceWorldEnv", "ScienceWorldSuite", "require_java", "all_task_names", "JAVA_HINT"]
