"""ALFWorld household tasks (text-only, TextWorld engine) as a ``TaskSuite`` (docs/environments.md).

ALFWorld's games are PDDL problems played by TextWorld's PDDL engine (``textworld[pddl]``, the
``fast-downward-textworld`` planner). Each game is a ``game.tw-pddl`` JSON file holding the PDDL domain,
the problem, the text grammar (with the goal sentence) and a ``solvable`` flag. The data is not in the
package: download it once with ``alfworld-download`` (into ``$ALFWORLD_DATA``,
default ``~/.cache/alfworld``), then point ``data_dir`` at that folder.

Layout read: ``<data_dir>/json_2.1.1/<split>/<task_type>-<object>-<...>-<scene>/<trial>/game.tw-pddl``
with splits ``train`` (3553 games), ``valid_seen`` (140) and ``valid_unseen`` (134). As in ALFWorld's
own loader, games with movable receptacles or sliced objects and games not marked solvable are skipped.

Observations: the game's text without the ``-= Welcome to TextWorld, ALFRED! =-`` banner (the first
one ends with ``Your task is to: ...``), then ``Valid actions: ...`` (the admissible commands, sorted,
without ``help``) while the episode runs; ``info["admissible_actions"]`` holds the same list. Reward is
1 on the step that completes the task and 0 otherwise; the episode ends on success or after
``max_turns`` steps (25 in the R³L paper). An unknown command answers "Nothing happens." and sets
``invalid_action``.

Demonstrations are the game's stored walkthrough or, when it has none, a plan from the Fast Downward
planner (TextWorld's ``walkthrough`` extra); computed once per game and cached.

Splits: training tasks come from ``train_split``; task ``i`` walks the games in a per-epoch shuffle.
Validation is the first ``num_val_tasks`` games (sorted by path) of ``val_split``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Optional

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.common import (
    SimulatorPool,
    attach_lease,
    close_simulator,
    finite_index,
    import_optional,
    normalize_command,
    valid_actions_line,
)

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
DATA_ENV_VAR = "ALFWORLD_DATA"
WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
HIDDEN_COMMANDS = frozenset({"help"})

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a household. Complete the task stated in the first message in as few actions "
    "as possible. Each turn, reply with exactly one action copied from the valid actions, inside "
    "<action>...</action>, for example <action>look</action>."
)


def default_data_dir() -> Path:
    """``$ALFWORLD_DATA``, else ALFWorld's own default ``~/.cache/alfworld``."""
    return Path(os.environ.get(DATA_ENV_VAR) or Path.home() / ".cache" / "alfworld").expanduser()


def missing_data_message(where: Path, detail: str) -> str:
    return (
        f"ALFWorld data not found: {detail} (looked in {str(where)!r}). Download it once with "
        f"`alfworld-download` (it writes to ${DATA_ENV_VAR}, default ~/.cache/alfworld), "
        f"then set {DATA_ENV_VAR} or the suite's data_dir to that folder."
    )


def task_type_of(game_file: Path) -> str:
    """The task type from the folder name ``<task_type>-<object>-...`` above the trial folder."""
    return game_file.parent.parent.name.split("-", 1)[0]


def discover_games(split_dir: Path, task_types: tuple[str, ...]) -> list[Path]:
    """Playable ``game.tw-pddl`` files under ``split_dir``, sorted, filtered like ALFWorld's loader."""
    games = []
    for path in sorted(split_dir.rglob("game.tw-pddl")):
        text = str(path)
        if "movable" in text or "Sliced" in text:
            continue
        if task_type_of(path) not in task_types:
            continue
        with open(path) as f:
            if not json.load(f).get("solvable", False):
                continue
        games.append(path)
    return games


def clean_alfworld_text(text: str) -> str:
    return text.replace(WELCOME, "").strip()


def _start_alfworld(game_file: Hashable) -> Any:
    textworld = import_optional("textworld", "ALFWorld games")
    alfred_tw_env = import_optional("alfworld.agents.environment.alfred_tw_env", "ALFWorld games")
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    return textworld.start(str(game_file), request_infos=infos, wrappers=[alfred_tw_env.AlfredDemangler(shuffle=False)])


class ALFWorldEnv:
    """One episode of an ALFWorld game at a time (see the module docstring)."""

    def __init__(self, suite: "ALFWorldSuite") -> None:
        self.suite = suite
        self.max_turns = suite.max_turns
        self._lease = attach_lease(self, suite.pool)
        self._turns = 0
        self._done = True
        self._admissible: list[str] = []

    def _set_admissible(self, state: Any) -> None:
        self._admissible = sorted(c for c in state["admissible_commands"] or [] if c not in HIDDEN_COMMANDS)

    def _with_actions(self, text: str) -> str:
        if not self.suite.list_admissible:
            return text
        return f"{text}\n{valid_actions_line(self._admissible)}"

    def reset(self, task: Task) -> str:
        game = self._lease.acquire(task.data["game_file"])
        state = game.reset()
        self._turns, self._done = 0, False
        self._set_admissible(state)
        return self._with_actions(clean_alfworld_text(state.feedback))

    def step(self, action: str) -> StepResult:
        if self._done or self._lease.sim is None:
            raise RuntimeError("ALFWorldEnv.step called before reset or after the episode ended")
        command = normalize_command(action)
        invalid = command not in self._admissible and command not in HIDDEN_COMMANDS
        self._lease.busy = True
        state, _, _ = self._lease.sim.step(command)
        self._lease.busy = False
        self._turns += 1
        won = bool(state["won"])
        self._done = won or self._turns >= self.max_turns
        feedback = clean_alfworld_text(state.feedback)
        if self._done:
            self._admissible = []
            self._lease.release()
            text = f"{feedback}\n{'Task complete.' if won else 'You have run out of turns.'}"
        else:
            self._set_admissible(state)
            text = self._with_actions(feedback)
        info = {"feedback": feedback, "success": won, "admissible_actions": list(self._admissible),
                "invalid_action": invalid}
        return StepResult(observation=text, reward=1.0 if won else 0.0, done=self._done, info=info)


class ALFWorldSuite(TaskSuite):
    """ALFWorld's text games from the downloaded data (``alfworld-download``)."""

    def __init__(
        self,
        data_dir: Optional[str] = None,
        train_split: str = "train",
        val_split: str = "valid_unseen",
        task_types: Optional[list[str]] = None,
        num_val_tasks: Optional[int] = None,
        max_turns: int = 25,
        list_admissible: bool = True,
        seed: int = 0,
        max_idle_games: int = 64,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        """
        Args:
            data_dir: the ALFWorld data folder (holding ``json_2.1.1``); default ``$ALFWORLD_DATA``,
                else ``~/.cache/alfworld``. The ``json_2.1.1`` folder itself is accepted too.
            train_split: split folder of training games.
            val_split: split folder of validation games (``valid_seen`` or ``valid_unseen``).
            task_types: subset of ``TASK_TYPES`` (default: all six).
            num_val_tasks: validation games (the first ones, sorted by path); None: the whole split.
            max_turns: episode step limit (25 as in the R³L paper).
            list_admissible: append ``Valid actions: ...`` to every observation.
            seed: seed of the per-epoch shuffle of training games.
            max_idle_games: started games kept for reuse between episodes.
            system_prompt: system message of every conversation.
        """
        import_optional("textworld", "ALFWorld games")
        import_optional("alfworld", "ALFWorld games")
        import_optional("fast_downward", "ALFWorld's PDDL engine, textworld[pddl]")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        types = tuple(task_types) if task_types else TASK_TYPES
        unknown = sorted(set(types) - set(TASK_TYPES))
        if unknown:
            raise ValueError(f"unknown ALFWorld task types {unknown}; known: {list(TASK_TYPES)}")
        self.task_types = types
        root = Path(data_dir).expanduser() if data_dir else default_data_dir()
        self.data_dir = root
        self.games_root = root / "json_2.1.1" if (root / "json_2.1.1").is_dir() else root
        self.train_split, self.val_split = train_split, val_split
        self.num_val_tasks = num_val_tasks
        self.max_turns = max_turns
        self.list_admissible = list_admissible
        self.seed = seed
        self.system_prompt = system_prompt
        self.pool = SimulatorPool(_start_alfworld, close_simulator, max_idle=max_idle_games)
        if not root.is_dir():
            raise FileNotFoundError(missing_data_message(root, "the folder does not exist"))
        if not self._train_games:
            raise FileNotFoundError(missing_data_message(
                root, f"no playable game.tw-pddl under {str(self.games_root / train_split)!r}"))

    @cached_property
    def _train_games(self) -> list[Path]:
        return discover_games(self.games_root / self.train_split, self.task_types)

    @cached_property
    def _val_games(self) -> list[Path]:
        games = discover_games(self.games_root / self.val_split, self.task_types)
        return games if self.num_val_tasks is None else games[: self.num_val_tasks]

    def _task(self, path: Path) -> Task:
        name = str(path.parent.relative_to(self.games_root))
        return Task(task_id=f"alfworld:{name}", prompt=f"ALFWorld game {name}",
                    data={"game_file": str(path), "task_type": task_type_of(path)})

    def make_env(self) -> ALFWorldEnv:
        return ALFWorldEnv(self)

    def train_task(self, index: int) -> Task:
        games = self._train_games
        return self._task(games[finite_index(self.seed, index, len(games))])

    def val_tasks(self) -> list[Task]:
        return [self._task(p) for p in self._val_games]

    def demonstration(self, task: Task) -> Optional[list[str]]:
        plan = _walkthrough(task.data["game_file"])
        return None if plan is None else list(plan)


@lru_cache(maxsize=8192)
def _walkthrough(game_file: str) -> Optional[tuple[str, ...]]:
    """The game's stored walkthrough, else a Fast Downward plan (names demangled as in play)."""
    textworld = import_optional("textworld", "ALFWorld games")
    alfred_tw_env = import_optional("alfworld.agents.environment.alfred_tw_env", "ALFWorld games")
    infos = textworld.EnvInfos(extras=["walkthrough"])
    env = textworld.start(game_file, request_infos=infos, wrappers=[alfred_tw_env.AlfredDemangler(shuffle=False)])
    try:
        plan = env.reset().get("extra.walkthrough")
    finally:
        env.close()
    return tuple(plan) if plan else None


__all__ = ["ALFWorldEnv", "ALFWorldSuite", "TASK_TYPES", "discover_games", "default_data_dir"]
