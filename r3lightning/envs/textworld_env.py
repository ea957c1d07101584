"""TextWorld games (the ``textworld`` package) as a ``TaskSuite`` (docs/environments.md).

Games come from one of two sources:

* ``games_dir``: a folder of games compiled beforehand, offline, e.g. with
  ``tw-make custom --world-size 3 --nb-objects 5 --quest-length 3 --seed 1 --output games/g1.z8``.
  Every ``*.z8`` file (with its ``.json`` twin, which ``tw-make`` writes next to it) is one game.
* generated on the fly from ``(seed, world_size, nb_objects, quest_length)`` with TextWorld's Python
  generator into ``cache_dir``; a game is generated the first time an episode or a demonstration needs
  it (about 2 s) and reused from the cache afterwards.

Observations are the game's text with the ASCII-art banner and the ``>`` prompt/status line removed,
followed by ``Valid actions: ...`` (TextWorld's admissible commands, sorted) while the episode runs;
``info["admissible_actions"]`` holds the same list. Reward is the game score divided by its maximum
score (in [0, 1], the episode's reward so far); success is TextWorld's ``won``. An episode ends when the
game is won or lost or after ``max_turns`` steps.

Splits are by game seed. Generated games: training seeds are even and validation seeds odd (derived by
hashing the suite seed, split and index), so the splits never share a game. ``games_dir``: each game's
rank is the SHA-256 of its file name; the ``num_val_tasks`` lowest-ranked games are validation, the rest
training, which is stable when games are added or listed in another order.

Helpers shared with the other adapters (optional imports, the simulator pool, command normalization,
finite-dataset indexing) live in ``envs.common``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import warnings
from collections.abc import Hashable, Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Optional

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.common import (
    attach_lease,
    close_simulator,
    finite_index,
    import_optional,
    normalize_command,
    SimulatorPool,
    split_seed,
    valid_actions_line,
)

# ---------------------------------------------------------------------------------------------------
# TextWorld text


_BANNER_LINE = re.compile(r"^[\s_\\|/$>]+$")
_END_PROMPT = "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO"


def clean_text(text: str) -> str:
    """Game text without the ASCII-art banner, the ``>`` prompt and status line, and blank runs."""
    lines = text.split("\n")
    cut = len(lines)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(">"):
            cut = i
            break
    kept = [line.strip() for line in lines[:cut]
            if not (line.strip() and _BANNER_LINE.match(line)) and not line.startswith(_END_PROMPT)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


# ---------------------------------------------------------------------------------------------------
# Games


def generated_game_name(seed: int, world_size: int, nb_objects: int, quest_length: int) -> str:
    return f"tw-w{world_size}-o{nb_objects}-q{quest_length}-s{seed}"


def generate_game(path: str | os.PathLike, seed: int, world_size: int, nb_objects: int, quest_length: int) -> Path:
    """Generate and compile one game to ``path`` (``.z8``, with its ``.json`` next to it); a pure
    function of the settings. Written atomically, so concurrent workers may race on the same game."""
    textworld = import_optional("textworld", "TextWorld games")
    path = Path(path)
    if path.exists() and path.with_suffix(".json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    options = textworld.GameOptions()
    options.seeds = seed
    options.nb_rooms = world_size
    options.nb_objects = nb_objects
    options.quest_length = quest_length
    game = textworld.generator.make_game(options)
    game.metadata["walkthrough"] = game.walkthrough  # stored in the .json for demonstrations
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-") as tmp:
        options.path = os.path.join(tmp, path.name)
        options.force_recompile = True
        compiled = Path(textworld.generator.compile_game(game, options))
        os.replace(compiled.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(compiled, path)
    return path


def game_walkthrough(game_file: str | os.PathLike) -> Optional[list[str]]:
    """The walkthrough stored in the game's ``.json`` (written by ``tw-make`` and ``generate_game``),
    derived from its quests when absent; None when the game has neither."""
    meta = Path(game_file).with_suffix(".json")
    if not meta.exists():
        return None
    textworld = import_optional("textworld", "TextWorld games")
    walkthrough = textworld.Game.load(str(meta)).walkthrough
    return list(walkthrough) if walkthrough else None


# ---------------------------------------------------------------------------------------------------
# Environment


DEFAULT_SYSTEM_PROMPT = (
    "You are playing a text adventure game. Reach the goal stated in the first message in as few actions "
    "as possible. Each turn, reply with exactly one action copied from the valid actions, inside "
    "<action>...</action>, for example <action>look</action>."
)


def _start_textworld(game_file: Hashable) -> Any:
    textworld = import_optional("textworld", "TextWorld games")
    infos = textworld.EnvInfos(admissible_commands=True, score=True, max_score=True, won=True, lost=True)
    with quiet_jericho():
        return textworld.start(str(game_file), request_infos=infos)


_JERICHO_NOISE = r"(Unable to find valid actions in an unsupported game|Game .* is not fully supported)"


@contextlib.contextmanager
def quiet_jericho() -> Iterator[None]:
    """Jericho does not know TextWorld's games and warns so on load and on every step; TextWorld's own
    wrapper supplies the score and admissible commands, so the warnings carry no information."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JERICHO_NOISE)
        yield


class TextWorldEnv:
    """One episode of a TextWorld game at a time (see the module docstring)."""

    def __init__(self, suite: "TextWorldSuite") -> None:
        self.suite = suite
        self.max_turns = suite.max_turns
        self._lease = attach_lease(self, suite.pool)
        self._turns = 0
        self._done = True
        self._max_score = 1
        self._admissible: list[str] = []

    def reset(self, task: Task) -> str:
        game_file = self.suite.game_file(task)
        game = self._lease.acquire(game_file)
        with quiet_jericho():
            state = game.reset()
        self._turns, self._done = 0, False
        self._max_score = state["max_score"] or 0
        self._admissible = sorted(state["admissible_commands"] or [])
        text = clean_text(state.feedback)
        return self._with_actions(text)

    def _with_actions(self, text: str) -> str:
        if not self.suite.list_admissible:
            return text
        return f"{text}\n{valid_actions_line(self._admissible)}"

    def step(self, action: str) -> StepResult:
        if self._done or self._lease.sim is None:
            raise RuntimeError("TextWorldEnv.step called before reset or after the episode ended")
        command = normalize_command(action)
        invalid = command not in self._admissible
        self._lease.busy = True
        with quiet_jericho():
            state, score, _ = self._lease.sim.step(command)
        self._lease.busy = False
        self._turns += 1
        won, lost = bool(state["won"]), bool(state["lost"])
        reward = 1.0 if won else 0.0
        if self._max_score:
            reward = min(max(float(score) / self._max_score, 0.0), 1.0)
        self._done = won or lost or self._turns >= self.max_turns
        feedback = clean_text(state.feedback)
        self._admissible = [] if self._done else sorted(state["admissible_commands"] or [])
        if won:
            text = f"{feedback}\nTask complete."
        elif lost:
            text = f"{feedback}\nYou lost the game."
        elif self._done:
            text = f"{feedback}\nYou have run out of turns."
        else:
            text = self._with_actions(feedback)
        if self._done:
            self._lease.release()
        info = {
            "feedback": feedback,
            "success": won,
            "admissible_actions": list(self._admissible),
            "invalid_action": invalid,
            "score": score,
            "max_score": self._max_score,
        }
        return StepResult(observation=text, reward=reward, done=self._done, info=info)


class TextWorldSuite(TaskSuite):
    """TextWorld games, pre-made in ``games_dir`` or generated on the fly into ``cache_dir``."""

    def __init__(
        self,
        games_dir: Optional[str] = None,
        cache_dir: Optional[str] = None,
        world_size: int = 3,
        nb_objects: int = 5,
        quest_length: int = 3,
        num_train_games: Optional[int] = 1000,
        num_val_tasks: int = 32,
        max_turns: int = 30,
        list_admissible: bool = True,
        seed: int = 0,
        max_idle_games: int = 64,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        """
        Args:
            games_dir: folder of compiled games (``*.z8`` with their ``.json``), e.g. made with
                ``tw-make``; searched recursively. When set, the generation settings are ignored.
            cache_dir: where generated games are written (default
                ``$XDG_CACHE_HOME/r3lightning/textworld``, i.e. ``~/.cache/r3lightning/textworld``).
            world_size: rooms per generated game (``tw-make custom --world-size``).
            nb_objects: objects per generated game (``--nb-objects``).
            quest_length: actions in the generated quest (``--quest-length``).
            num_train_games: generated training games; task ``i`` is game ``i % num_train_games`` (each
                pass reshuffled). None: every index is a new game.
            num_val_tasks: held-out validation games.
            max_turns: episode step limit.
            list_admissible: append ``Valid actions: ...`` to every observation.
            seed: suite seed; generated games are a pure function of (seed, settings, split, index).
            max_idle_games: started games kept for reuse between episodes.
            system_prompt: system message of every conversation.
        """
        import_optional("textworld", "TextWorld games")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if num_val_tasks < 0:
            raise ValueError(f"num_val_tasks must be >= 0, got {num_val_tasks}")
        if num_train_games is not None and num_train_games < 1:
            raise ValueError(f"num_train_games must be >= 1 or null, got {num_train_games}")
        self.games_dir = Path(games_dir).expanduser() if games_dir else None
        cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "r3lightning" / "textworld"
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else cache_root
        self.world_size, self.nb_objects, self.quest_length = world_size, nb_objects, quest_length
        self.num_train_games = num_train_games
        self.num_val_tasks = num_val_tasks
        self.max_turns = max_turns
        self.list_admissible = list_admissible
        self.seed = seed
        self.system_prompt = system_prompt
        self.pool = SimulatorPool(_start_textworld, close_simulator, max_idle=max_idle_games)
        if self.games_dir is not None:
            if not self.games_dir.is_dir():
                raise FileNotFoundError(f"games_dir {str(self.games_dir)!r} is not a folder")
            if not self._dir_games:
                raise FileNotFoundError(
                    f"no TextWorld games (*.z8) in {str(self.games_dir)!r}; make some offline with e.g. "
                    "`tw-make custom --world-size 3 --nb-objects 5 --quest-length 3 --seed 1 --output "
                    f"{self.games_dir}/g1.z8`"
                )

    # -- tasks

    @cached_property
    def _dir_games(self) -> list[Path]:
        assert self.games_dir is not None
        return sorted(self.games_dir.rglob("*.z8"))

    @cached_property
    def _dir_split(self) -> tuple[list[Path], list[Path]]:
        """(train, val) games of ``games_dir``, val = the lowest SHA-256 ranks of the file names."""
        ranked = sorted(self._dir_games, key=lambda p: hashlib.sha256(
            str(p.relative_to(self.games_dir)).encode()).hexdigest())
        val = sorted(ranked[: self.num_val_tasks])
        train = sorted(ranked[self.num_val_tasks :])
        if not train:
            raise ValueError(f"{len(ranked)} games in {str(self.games_dir)!r} leave none for training "
                             f"after {self.num_val_tasks} validation games")
        return train, val

    def _dir_task(self, path: Path, split: str) -> Task:
        name = str(path.relative_to(self.games_dir))
        return Task(task_id=f"textworld:{name}", prompt=f"TextWorld game {name}",
                    data={"game_file": str(path), "split": split})

    def _generated_task(self, split: str, index: int) -> Task:
        seed = split_seed(self.seed, split, index)
        name = generated_game_name(seed, self.world_size, self.nb_objects, self.quest_length)
        return Task(
            task_id=f"textworld:{name}",
            prompt=f"TextWorld game {name}",
            data={"game_file": str(self.cache_dir / f"{name}.z8"), "split": split, "seed": seed,
                  "world_size": self.world_size, "nb_objects": self.nb_objects, "quest_length": self.quest_length},
        )

    def train_task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"train_task index must be >= 0, got {index}")
        if self.games_dir is not None:
            train = self._dir_split[0]
            return self._dir_task(train[finite_index(self.seed, index, len(train))], "train")
        if self.num_train_games is not None:
            index = finite_index(self.seed, index, self.num_train_games)
        return self._generated_task("train", index)

    def val_tasks(self) -> list[Task]:
        if self.games_dir is not None:
            return [self._dir_task(p, "val") for p in self._dir_split[1]]
        return [self._generated_task("val", i) for i in range(self.num_val_tasks)]

    def game_file(self, task: Task) -> str:
        """The task's compiled game, generated first if it is a generated game not yet in the cache."""
        path = Path(task.data["game_file"])
        if "seed" in task.data and not (path.exists() and path.with_suffix(".json").exists()):
            generate_game(path, int(task.data["seed"]), int(task.data["world_size"]), int(task.data["nb_objects"]),
                          int(task.data["quest_length"]))
        if not path.exists():
            raise FileNotFoundError(f"TextWorld game {str(path)!r} not found")
        return str(path)

    def prepare(self, tasks: list[Task]) -> None:
        """Generate the games of ``tasks`` now (e.g. ``suite.prepare(suite.val_tasks())``)."""
        for task in tasks:
            self.game_file(task)

    # -- environment and expert

    def make_env(self) -> TextWorldEnv:
        return TextWorldEnv(self)

    def demonstration(self, task: Task) -> Optional[list[str]]:
        walkthrough = _cached_walkthrough(self.game_file(task))
        return None if walkthrough is None else list(walkthrough)


@lru_cache(maxsize=4096)
def _cached_walkthrough(game_file: str) -> Optional[tuple[str, ...]]:
    walkthrough = game_walkthrough(game_file)
    if walkthrough is not None:
        return tuple(walkthrough)
    # No .json (a game made elsewhere): ask the engine for a winning policy.
    textworld = import_optional("textworld", "TextWorld games")
    with quiet_jericho():
        env = textworld.start(game_file, request_infos=textworld.EnvInfos(policy_commands=True))
    try:
        with quiet_jericho():
            policy = env.reset()["policy_commands"]
    finally:
        env.close()
    return tuple(policy) if policy else None


__all__ = [
    "TextWorldEnv", "TextWorldSuite", "SimulatorPool", "clean_text", "generate_game", "game_walkthrough",
    "import_optional", "normalize_command",
]
