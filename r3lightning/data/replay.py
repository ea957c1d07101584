"""Replay buffer for R³ cross-context replay, and the per-task outcome history read by in-context
self-reflection (Jiang et al., arXiv 2601.19620; the paper's code is not released).

When a group's rewards collapse (all fail or all succeed), the caller injects past trajectories of the
same task with the opposite outcome, so the group has an advantage gap again. The buffer keeps them:

- keyed by task id, a deep copy of each added trajectory (turns with tokens and behaviour log-probs,
  reward, success, origin, ``model_version`` = the weight version that made it) and the training step
  it was added at;
- bounded per task and outcome (``max_per_task`` successes and as many failures) and in total
  (``max_total``), oldest evicted first: a task over a bound drops its own oldest of that outcome,
  then a buffer over its total drops the globally oldest. Bounding the outcomes separately keeps a
  task's rare success even when it keeps failing, and that success is what an all-fail group needs;
- ``sample`` draws uniformly at random, without replacement, with the caller's ``random.Random``, so
  replay is reproducible from the seeded rng and does not always replay the same few trajectories.
  Staleness is bounded by ``max_per_task``; the returned step and ``model_version`` let the caller
  filter further.

The outcome history (``record_visit`` / ``recent_failures``) is separate from the stored trajectories:
one short bounded deque of outcomes per task visited, so "this task keeps failing" is known even for
trajectories the caller chose not to store.

The buffer is part of the checkpoint. Lightning loads checkpoints with ``torch.load(weights_only=True)``,
which refuses custom classes, so ``state_dict`` holds only dicts, lists, tuples, int, float, str, bool and
None: a nested dataclass field (``Trajectory.guided_turn``) is saved as a dict of its fields and rebuilt
from the field's type hint. ``add`` rejects a trajectory whose fields (``info`` included) hold anything
else, rather than fail later at checkpoint time. No lightning import here: the pure data layer is tested
without a Trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import random
import typing
from collections import OrderedDict, deque
from typing import Any

from r3lightning.data.state_checks import expect_int, expect_type
from r3lightning.types import Trajectory, Turn

TRAJECTORY_OVERHEAD_BYTES = 1024
"""Fixed per-trajectory cost in the ``num_bytes`` estimate: Python objects, dicts and list headers."""

_STATE_VERSION = 1
_TOKEN_FIELDS = ("context_ids", "response_ids", "logprobs")
_PLAIN_SCALARS = (int, float, str, bool, type(None))


class ReplayBuffer:
    """Past trajectories per task, bounded per task and in total, oldest evicted first.

    max_per_task: trajectories kept per task and outcome; max_total: trajectories kept in all;
    max_visits: outcomes remembered per task for ``recent_failures``.
    """

    def __init__(self, max_per_task: int, max_total: int, max_visits: int = 32) -> None:
        for name, value in (("max_per_task", max_per_task), ("max_total", max_total), ("max_visits", max_visits)):
            if value < 1:
                raise ValueError(f"ReplayBuffer: {name} must be >= 1, got {value}")
        self.max_per_task = max_per_task
        self.max_total = max_total
        self.max_visits = max_visits
        self._clear()

    def _clear(self) -> None:
        # Insertion number -> entry, oldest first: the globally oldest is always the first item.
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        # (task id, success) -> its insertion numbers, oldest first; nothing stored, no key.
        self._by_task: dict[tuple[str, bool], deque[int]] = {}
        self._visits: dict[str, deque[bool]] = {}
        self._next_seq = 0
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, trajectory: Trajectory, step: int) -> None:
        """Store a copy of ``trajectory`` (keyed by its task id), added at training step ``step``,
        then evict the task's oldest of that outcome beyond ``max_per_task`` and the globally oldest
        beyond ``max_total``."""
        state = _trajectory_state(trajectory)
        _check_plain(state, trajectory.task_id)
        self._insert(self._next_seq, state, int(step))
        self._next_seq += 1

    def sample(self, task_id: str, want_success: bool, k: int, rng: random.Random) -> list[tuple[Trajectory, int]]:
        """Up to ``k`` stored trajectories of ``task_id`` whose ``success`` equals ``want_success``, drawn
        uniformly without replacement by ``rng``, as ``(copy of the trajectory, step it was added at)``.

        Deterministic given the state of ``rng``. Returns copies: the caller may relabel or re-tokenize them.
        """
        if k < 0:
            raise ValueError(f"ReplayBuffer.sample: k must be >= 0, got {k}")
        matching = [self._entries[seq] for seq in self._by_task.get((task_id, bool(want_success)), ())]
        picked = rng.sample(matching, min(k, len(matching)))
        return [(_copy_trajectory(entry.trajectory), entry.step) for entry in picked]

    def tasks_with_history(self) -> list[str]:
        """Task ids with at least one stored trajectory, sorted."""
        return sorted({task_id for task_id, _ in self._by_task})

    def num_bytes(self) -> int:
        """Estimated memory of the stored trajectories: 8 bytes per token id, log-prob and other number,
        the UTF-8 length of every string, plus ``TRAJECTORY_OVERHEAD_BYTES`` per trajectory. A gauge for
        sizing ``max_total``, not an exact count of Python object sizes; the visit history is not counted."""
        return self._num_bytes

    def record_visit(self, task_id: str, success: bool) -> None:
        """Remember one outcome of ``task_id``; only the last ``max_visits`` are kept."""
        self._visits.setdefault(task_id, deque(maxlen=self.max_visits)).append(bool(success))

    def recent_failures(self, task_id: str, m: int) -> bool:
        """True when the last ``m`` recorded visits of ``task_id`` all failed (False with fewer than ``m``)."""
        if not 1 <= m <= self.max_visits:
            raise ValueError(f"ReplayBuffer.recent_failures: m must be in [1, max_visits={self.max_visits}], got {m}")
        history = self._visits.get(task_id, ())
        return len(history) >= m and not any(itertools.islice(reversed(history), m))

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only (loadable with ``torch.load(weights_only=True)``)."""
        entries = [
            {"seq": seq, "step": entry.step, "trajectory": _trajectory_state(entry.trajectory)}
            for seq, entry in self._entries.items()
        ]
        visits = {task_id: list(history) for task_id, history in self._visits.items()}
        return {"version": _STATE_VERSION, "next_seq": self._next_seq, "entries": entries, "visits": visits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``. The bounds are this buffer's own: if they are smaller than when the
        state was saved, the oldest entries are evicted as if they had been added under these bounds.
        A damaged state is refused (``check_replay_state``) before anything is changed."""
        try:
            check_replay_state(state)
        except ValueError as err:
            raise ValueError(f"ReplayBuffer.load_state_dict: {err}") from None
        self._clear()
        for item in state["entries"]:
            self._insert(int(item["seq"]), item["trajectory"], int(item["step"]))
        self._next_seq = int(state["next_seq"])
        for task_id, history in state["visits"].items():
            self._visits[task_id] = deque((bool(s) for s in history), maxlen=self.max_visits)

    def _insert(self, seq: int, state: dict[str, Any], step: int) -> None:
        """Store the trajectory of ``state`` (a ``_trajectory_state``) and evict beyond the bounds."""
        entry = _Entry(_trajectory_from_state(state), step, _estimate_bytes(state))
        self._entries[seq] = entry
        self._num_bytes += entry.num_bytes
        task_seqs = self._by_task.setdefault(_key(entry.trajectory), deque())
        task_seqs.append(seq)
        while len(task_seqs) > self.max_per_task:
            self._drop_oldest_of_task(task_seqs[0])
        while len(self._entries) > self.max_total:
            self._drop_oldest_of_task(next(iter(self._entries)))

    def _drop_oldest_of_task(self, seq: int) -> None:
        # Insertion numbers grow, so the globally oldest entry is also the oldest of its own task:
        # both eviction rules remove the head of that task's deque.
        entry = self._entries.pop(seq)
        self._num_bytes -= entry.num_bytes
        key = _key(entry.trajectory)
        task_seqs = self._by_task[key]
        task_seqs.popleft()
        if not task_seqs:
            del self._by_task[key]


def _key(trajectory: Trajectory) -> tuple[str, bool]:
    return trajectory.task_id, bool(trajectory.success)


@dataclasses.dataclass
class _Entry:
    trajectory: Trajectory
    step: int
    num_bytes: int


def _plain_fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The dataclass fields of ``obj`` not in ``skip``, copied, with nested dataclass values (such as
    ``Trajectory.guided_turn``) turned into dicts of their own fields."""
    state = {}
    for f in dataclasses.fields(obj):
        if f.name not in skip:
            value = getattr(obj, f.name)
            is_dataclass_value = dataclasses.is_dataclass(value) and not isinstance(value, type)
            state[f.name] = _plain_fields(value) if is_dataclass_value else copy.deepcopy(value)
    return state


def _build(cls: type, state: dict[str, Any], **given: Any) -> Any:
    """Instance of dataclass ``cls`` from ``_plain_fields`` output plus ``given`` fields, copying ``state``.
    A dict is turned back into a dataclass where the field's type hint names one (``Optional[X]`` too)."""
    hints = _type_hints(cls)
    kwargs = dict(given)
    for name, value in state.items():
        if name in given:
            continue
        if name not in hints:
            raise ValueError(f"ReplayBuffer: {cls.__name__} has no field {name!r} (state saved by another version?)")
        nested = next((t for t in (hints[name], *typing.get_args(hints[name])) if dataclasses.is_dataclass(t)), None)
        kwargs[name] = _build(nested, value) if nested is not None and type(value) is dict else copy.deepcopy(value)
    return cls(**kwargs)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _trajectory_state(trajectory: Trajectory) -> dict[str, Any]:
    """A trajectory as fresh plain containers. Token lists are copied with ``map`` (C speed) rather than
    ``deepcopy``, which would walk every token in Python; ``int``/``float`` turn numpy scalars into
    plain numbers."""
    state = _plain_fields(trajectory, skip=("turns",))
    state["turns"] = []
    for turn in trajectory.turns:
        turn_state = _plain_fields(turn, skip=_TOKEN_FIELDS)
        turn_state["context_ids"] = list(map(int, turn.context_ids))
        turn_state["response_ids"] = list(map(int, turn.response_ids))
        turn_state["logprobs"] = None if turn.logprobs is None else list(map(float, turn.logprobs))
        state["turns"].append(turn_state)
    return state


def check_replay_state(state: Any) -> None:
    """ValueError ``"<field>: <problem>"`` (``version``, ``entries[3].trajectory``...) when ``state`` is not a
    ``ReplayBuffer.state_dict`` this version can load: every entry's trajectory is rebuilt once to
    check it."""
    expect_type(state, dict, "state")
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"version: unknown state version {state.get('version')!r} (this r3lightning reads {_STATE_VERSION})")
    for key in ("next_seq", "entries", "visits"):
        if key not in state:
            raise ValueError(f"{key}: missing")
    expect_int(state["next_seq"], "next_seq")
    expect_type(state["entries"], list, "entries")
    for index, item in enumerate(state["entries"]):
        where = f"entries[{index}]"
        expect_type(item, dict, where)
        for key in ("seq", "step", "trajectory"):
            if key not in item:
                raise ValueError(f"{where}.{key}: missing")
        expect_int(item["seq"], f"{where}.seq")
        expect_int(item["step"], f"{where}.step", minimum=None)
        expect_type(item["trajectory"], dict, f"{where}.trajectory")
        try:
            _trajectory_from_state(item["trajectory"])
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{where}.trajectory: cannot be rebuilt ({type(err).__name__}: {err})") from None
    expect_type(state["visits"], dict, "visits")
    for task_id, history in state["visits"].items():
        expect_type(history, list, f"visits[{task_id!r}]")


def _trajectory_from_state(state: dict[str, Any]) -> Trajectory:
    """Rebuild a trajectory from ``_trajectory_state``, copying so that ``state`` stays independent."""
    turns = []
    for turn_state in state["turns"]:
        logprobs = turn_state["logprobs"]
        tokens = {
            "context_ids": list(turn_state["context_ids"]),
            "response_ids": list(turn_state["response_ids"]),
            "logprobs": None if logprobs is None else list(logprobs),
        }
        turns.append(_build(Turn, turn_state, **tokens))
    return _build(Trajectory, state, turns=turns)


def _copy_trajectory(trajectory: Trajectory) -> Trajectory:
    return _trajectory_from_state(_trajectory_state(trajectory))


def _non_plain(value: Any, place: str) -> str | None:
    """Where in ``value`` (named ``place``) the first value a weights-only checkpoint cannot hold sits,
    with its type; None when everything is plain."""
    # Exact types: numpy.float64 subclasses float but would pickle as a numpy object.
    if type(value) in _PLAIN_SCALARS:
        return None
    if type(value) in (list, tuple):
        found = (_non_plain(v, f"{place}[{i}]") for i, v in enumerate(value))
    elif type(value) is dict:
        found = (
            f"{place} key {k!r}" if type(k) is not str else _non_plain(v, f"{place}[{k!r}]") for k, v in value.items()
        )
    else:
        return f"{place} ({type(value).__name__})"
    return next((where for where in found if where is not None), None)


def _check_plain(state: dict[str, Any], task_id: str) -> None:
    """Raise if a field other than the (already converted) token lists holds a non-plain value."""
    places = [(f"Trajectory.{name}", value) for name, value in state.items() if name != "turns"]
    for i, turn_state in enumerate(state["turns"]):
        places += [(f"turns[{i}].{name}", v) for name, v in turn_state.items() if name not in _TOKEN_FIELDS]
    for place, value in places:
        where = _non_plain(value, place)
        if where is not None:
            raise ValueError(
                f"ReplayBuffer.add: trajectory of task {task_id!r}: {where} is not plain data; the buffer is "
                "checkpointed for torch.load(weights_only=True) and stores only int, float, str, bool, None "
                "and lists, tuples and str-keyed dicts of them"
            )


def _estimate_bytes(state: dict[str, Any]) -> int:
    """``num_bytes`` of one trajectory, from its ``_trajectory_state``."""
    total = TRAJECTORY_OVERHEAD_BYTES
    total += _plain_bytes([value for name, value in state.items() if name != "turns"])
    for turn_state in state["turns"]:
        numbers = len(turn_state["context_ids"]) + len(turn_state["response_ids"]) + len(turn_state["logprobs"] or ())
        total += 8 * numbers + _plain_bytes([v for name, v in turn_state.items() if name not in _TOKEN_FIELDS])
    return total


def _plain_bytes(value: Any) -> int:
    """8 bytes per number, bool or None, UTF-8 length per string, summed through containers."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, (list, tuple)):
        return sum(_plain_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_plain_bytes(k) + _plain_bytes(v) for k, v in value.items())
    return 8


@dataclasses.dataclass
class ReplayConfig:
    """R³'s cross-context replay (``data.replay``; docs/r3.md).

    Args:
        enabled: inject stored trajectories into groups whose rewards (nearly) agree.
        k: stored trajectories injected per such group, at most.
        agreement_tol: a group whose rewards span at most this much counts as agreeing.
        into_all_fail: put past successes into groups where every sample failed (the paper's case).
        into_all_success: also put past failures into groups where every sample succeeded.
        behaviour: how replayed samples are scored: ``stored`` (the clipped importance ratio against
            the log-probs of the policy that sampled them, with a ratio-based policy loss) or ``pinned``
            (plain on-policy treatment, ratio 1).
        max_per_task: trajectories kept per task and outcome.
        max_total: trajectories kept in all (``replay/size``; ``replay/bytes`` estimates their memory).
        max_age_steps: never replay a trajectory stored more than this many steps ago (null: no limit).
    """

    enabled: bool = False
    k: int = 1
    agreement_tol: float = 1e-6
    into_all_fail: bool = True
    into_all_success: bool = False
    behaviour: typing.Literal["stored", "pinned"] = "stored"
    max_per_task: int = 4
    max_total: int = 4096
    max_age_steps: typing.Optional[int] = None

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"data.replay.k must be >= 1, got {self.k}")
        if self.behaviour not in ("stored", "pinned"):
            raise ValueError(f"data.replay.behaviour must be 'stored' or 'pinned', got {self.behaviour!r}")


def flat_groups(rewards_per_group: list[list[float]], tol: float) -> list[bool]:
    """Whether each group's rewards span at most ``tol`` (no advantage gap)."""
    return [bool(rewards) and max(rewards) - min(rewards) <= tol for rewards in rewards_per_group]


def replay_into_groups(
    groups,
    buffer: ReplayBuffer,
    config: ReplayConfig,
    step: int,
    max_reward: float,
    rng: random.Random,
    rerender: typing.Callable[[Trajectory], Trajectory] = lambda trajectory: trajectory,
) -> dict[str, float]:
    """Cross-context replay for one step's groups (``r3lightning.types.Group``), in place.

    For every group whose rewards agree: if all failed (all succeeded), up to ``config.k`` stored
    trajectories of the task with the other outcome join it with origin ``replay``, their tokens
    passed through ``rerender`` (the prompt template may have changed since they were stored). Then
    the step is recorded for later steps — one visit per group (failed when no fresh sample
    succeeded) and a copy of every fresh trajectory — so a group never replays its own samples.
    Returns the figures of the step: ``replay/*`` and ``train/zero_variance_group_rate_before_replay``.
    """
    flat = flat_groups([g.rewards for g in groups], config.agreement_tol)
    rescued, hits, ages, wanted = 0, 0, [], 0
    for group, is_flat in zip(groups, flat):
        if not is_flat or config.k <= 0:
            continue
        solved = min(group.rewards) >= max_reward
        if (solved and not config.into_all_success) or (not solved and not config.into_all_fail):
            continue
        wanted += 1
        found = buffer.sample(group.task_id, want_success=not solved, k=config.k, rng=rng)
        found = [(t, added) for t, added in found if config.max_age_steps is None or step - added <= config.max_age_steps]
        if not found:
            continue
        hits += 1
        for trajectory, added in found:
            # No pivot: the partner it shared a prefix with is not in this group.
            group.trajectories.append(dataclasses.replace(rerender(trajectory), origin="replay", pivot=None))
            ages.append(step - added)
        rescued += int(not flat_groups([group.rewards], config.agreement_tol)[0])
    record_step(groups, buffer, step)
    return {
        "train/zero_variance_group_rate_before_replay": sum(flat) / max(len(flat), 1),
        "replay/rescued_group_rate": rescued / max(len(groups), 1),
        "replay/hit_rate": hits / max(wanted, 1),
        "replay/age_steps": sum(ages) / len(ages) if ages else 0.0,
        "replay/injected": float(len(ages)),
        "replay/size": float(len(buffer)),
        "replay/bytes": float(buffer.num_bytes()),
    }


def record_step(groups, buffer: ReplayBuffer, step: int) -> None:
    """One visit per group (failed when no fresh sample succeeded) and a copy of every fresh sample of
    the plain prompt whose reward is sound. In-context reflection reads the visits; replay reads the
    copies."""
    for group in groups:
        # Samples of the plain prompt only: an in-context sample's prompt holds a past attempt.
        fresh = [t for t in group.trajectories if t.origin in ("base", "distilled") and not t.reward_error]
        if not fresh:
            continue
        buffer.record_visit(group.task_id, any(t.success for t in fresh))
        for trajectory in fresh:
            buffer.add(trajectory, step)
