"""An offline, deterministic, ALFWorld-like household text world (docs/environments.md).

Every task is "put the <object> in/on the <receptacle>". Worlds are generated from an integer seed and
a difficulty level, in pure Python, so tasks cost microseconds and replay exactly.

World: rooms joined by exits (a tree), receptacles in rooms (surfaces such as a table, containers such
as a fridge that can be open, closed or locked), portable objects on or in receptacles, and at most one
key. The agent carries any number of objects.

Command grammar (lowercase, single-word names)::

    look | inventory | go to <room> | take <obj> | take <obj> from <receptacle>
    put <obj> in <container> | put <obj> on <surface> | open <container> | close <container>
    unlock <container> with key | examine <thing>

``go to`` only reaches a room adjacent to the current one. Every observation ends with
"Valid actions: ..." (sorted), and ``info["admissible_actions"]`` holds the same list; ``take <obj>
from <receptacle>`` is accepted but listed in its short form ``take <obj>``. A response may wrap the
command in ``<action>...</action>``; the first such block is used, as in the agent loop.

Difficulty:
    1. One room, 2-3 receptacles, every container open, 1-2 distractor objects.
    2. One room, 3 receptacles, containers closed with probability 0.6, 2-3 distractors.
    3. 2-3 rooms of 2-3 receptacles, the object in a different room than its destination, containers
       closed with probability 0.5, 2-3 distractors.
    4. 3-4 rooms as in 3, plus one locked container (it holds the object or is the destination) whose
       key lies in another room, possibly in a closed container; 3-4 distractors.

Optimal plans are 2 actions long at level 1, 2-4 at level 2, 3-8 at level 3 and 6-16 at level 4.

Reward: 1.0 on the step that achieves the goal, 0.0 otherwise (no partial credit). An episode ends on
success or after ``max_turns`` steps.

Optimal planning. Distractor objects never affect what the agent can do, no action locks anything and
carrying is unbounded, so a shortest plan is: the required stops (fetch the key when a needed container
is locked, fetch the object, deliver it) in the cheapest order the dependencies allow, with the shortest
route between stops and, at each stop, exactly the unlock/open actions it needs. Each such action is
necessary and the routes are shortest, so the plan is optimal; the tests check it against a
breadth-first search over world states. The diagnostician's pivot is the first step after which the
optimal distance to the goal did not drop by one.

Splits: training tasks use even generation seeds and validation tasks odd ones (derived by hashing the
suite seed, split and index), so their ids never collide. Disjointness is by seed: identical layouts from
different seeds are possible in principle but rare (5000 training layouts at difficulty 1 are all
distinct).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Optional

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.common import normalize_command, split_seed

ROOM_NAMES = ("kitchen", "bedroom", "bathroom", "hallway", "office", "garage", "pantry", "study")
SURFACE_NAMES = ("table", "counter", "shelf", "desk", "bed", "sofa", "bench")
CONTAINER_NAMES = ("fridge", "drawer", "cabinet", "box", "chest", "safe", "closet", "locker")
OBJECT_NAMES = (
    "apple", "mug", "book", "pen", "spoon", "towel", "cup", "plate", "phone", "sock", "soap", "candle",
    "bowl", "watch",
)
KEY = "key"
INVENTORY = "inventory"
OPEN, CLOSED, LOCKED = "open", "closed", "locked"
INFO_VERBS = ("look", "inventory", "examine")

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a household text world. Complete the task in as few actions as possible. "
    "Each turn, reply with exactly one action copied from the valid actions, inside <action>...</action>, "
    "for example <action>look</action>."
)
DEFAULT_MAX_TURNS = {1: 8, 2: 12, 3: 20, 4: 32}
"""Twice the longest optimal plan a level can generate (2, 4, 8 and 16 actions) or more."""


@dataclass(frozen=True)
class Level:
    """Generation parameters of one difficulty level; (min, max) pairs are inclusive."""

    rooms: tuple[int, int]
    receptacles_per_room: tuple[int, int]
    distractors: tuple[int, int]
    closed_probability: float
    locked: bool


LEVELS = {
    1: Level(rooms=(1, 1), receptacles_per_room=(2, 3), distractors=(1, 2), closed_probability=0.0, locked=False),
    2: Level(rooms=(1, 1), receptacles_per_room=(3, 3), distractors=(2, 3), closed_probability=0.6, locked=False),
    3: Level(rooms=(2, 3), receptacles_per_room=(2, 3), distractors=(2, 3), closed_probability=0.5, locked=False),
    4: Level(rooms=(3, 4), receptacles_per_room=(2, 3), distractors=(3, 4), closed_probability=0.5, locked=True),
}


@dataclass(frozen=True)
class Receptacle:
    """Furniture: a surface (things go "on" it) or a container (things go "in" it; it can be closed)."""

    name: str
    room: str
    is_container: bool

    @property
    def preposition(self) -> str:
        return "in" if self.is_container else "on"


@dataclass(frozen=True)
class State:
    """Everything that changes during an episode; small and hashable so planning can memoize on it.

    locations: (object, receptacle name or ``INVENTORY``) pairs sorted by object.
    container_status: (container, ``OPEN``/``CLOSED``/``LOCKED``) pairs sorted by container.
    """

    room: str
    locations: tuple[tuple[str, str], ...]
    container_status: tuple[tuple[str, str], ...]

    @cached_property
    def _location_map(self) -> dict[str, str]:
        return dict(self.locations)

    @cached_property
    def _status_map(self) -> dict[str, str]:
        return dict(self.container_status)

    def where(self, obj: str) -> str:
        return self._location_map[obj]

    def status(self, receptacle: str) -> str:
        """Status of a receptacle; surfaces are always open."""
        return self._status_map.get(receptacle, OPEN)

    def contents(self, receptacle: str) -> list[str]:
        return [obj for obj, place in self.locations if place == receptacle]

    def held(self) -> list[str]:
        return self.contents(INVENTORY)

    def moved(self, obj: str, place: str) -> State:
        locations = tuple((o, place if o == obj else p) for o, p in self.locations)
        return State(self.room, locations, self.container_status)

    def with_status(self, container: str, status: str) -> State:
        statuses = tuple((c, status if c == container else s) for c, s in self.container_status)
        return State(self.room, self.locations, statuses)

    def in_room(self, room: str) -> State:
        return State(room, self.locations, self.container_status)


@dataclass(frozen=True)
class World:
    """The fixed layout of one task plus its initial state; equal worlds are identical tasks."""

    rooms: tuple[str, ...]
    exits: tuple[tuple[str, str], ...]
    receptacles: tuple[Receptacle, ...]
    goal_object: str
    goal_receptacle: str
    start: State

    @cached_property
    def _neighbour_map(self) -> dict[str, list[str]]:
        return {room: sorted({b for a, b in self.exits if a == room} | {a for a, b in self.exits if b == room})
                for room in self.rooms}

    @cached_property
    def _receptacle_map(self) -> dict[str, Receptacle]:
        return {r.name: r for r in self.receptacles}

    def neighbours(self, room: str) -> list[str]:
        return self._neighbour_map.get(room, [])

    def receptacle(self, name: str) -> Optional[Receptacle]:
        return self._receptacle_map.get(name)

    def receptacles_in(self, room: str) -> list[Receptacle]:
        return [r for r in self.receptacles if r.room == room]

    @property
    def objects(self) -> list[str]:
        return [obj for obj, _ in self.start.locations]

    @property
    def goal_text(self) -> str:
        destination = self.receptacle(self.goal_receptacle)
        assert destination is not None
        return f"put the {self.goal_object} {destination.preposition} the {self.goal_receptacle}"


@dataclass(frozen=True)
class Outcome:
    """Result of one command: the next state, the feedback sentence and whether the command failed."""

    state: State
    feedback: str
    invalid: bool


# ---------------------------------------------------------------------------------------------------
# Generation


@lru_cache(maxsize=4096)
def generate_world(seed: int, difficulty: int) -> World:
    """The world of generation seed ``seed`` at ``difficulty`` (a pure function, memoized)."""
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty}")
    level = LEVELS[difficulty]
    # A string seed hashes with SHA-512 inside random, so layouts do not depend on PYTHONHASHSEED.
    rng = random.Random(f"procedural-world:{difficulty}:{seed}")
    rooms = tuple(rng.sample(ROOM_NAMES, rng.randint(*level.rooms)))
    exits = tuple((rooms[rng.randrange(i)], rooms[i]) for i in range(1, len(rooms)))
    receptacles = _place_receptacles(rng, rooms, level)
    source, destination, locked = _pick_goal_receptacles(rng, receptacles, level)
    goal_object, *distractors = rng.sample(OBJECT_NAMES, 1 + rng.randint(*level.distractors))
    locations = {goal_object: source.name}
    for obj in distractors:
        locations[obj] = rng.choice(receptacles).name
    if locked is not None:
        # The key never lies in the container it opens, so every task is solvable.
        locations[KEY] = rng.choice([r for r in receptacles if r.room != locked.room]).name
    statuses = {}
    for r in receptacles:
        if r.is_container:
            statuses[r.name] = CLOSED if rng.random() < level.closed_probability else OPEN
    if locked is not None:
        statuses[locked.name] = LOCKED
    start = State(rng.choice(rooms), tuple(sorted(locations.items())), tuple(sorted(statuses.items())))
    return World(rooms, exits, receptacles, goal_object, destination.name, start)


def _place_receptacles(rng: random.Random, rooms: tuple[str, ...], level: Level) -> tuple[Receptacle, ...]:
    """Receptacles for every room, at least one surface and one container overall."""
    counts = [rng.randint(*level.receptacles_per_room) for _ in rooms]
    total = sum(counts)
    num_containers = rng.randint(max(1, total - len(SURFACE_NAMES)), min(len(CONTAINER_NAMES), total - 1))
    kinds = [True] * num_containers + [False] * (total - num_containers)
    rng.shuffle(kinds)
    containers = iter(rng.sample(CONTAINER_NAMES, num_containers))
    surfaces = iter(rng.sample(SURFACE_NAMES, total - num_containers))
    slots = [room for room, count in zip(rooms, counts) for _ in range(count)]
    return tuple(
        Receptacle(next(containers) if is_container else next(surfaces), room, is_container)
        for room, is_container in zip(slots, kinds)
    )


def _pick_goal_receptacles(
    rng: random.Random, receptacles: tuple[Receptacle, ...], level: Level
) -> tuple[Receptacle, Receptacle, Optional[Receptacle]]:
    """(source, destination, locked container or None); multi-room worlds put them in different rooms."""
    multi_room = level.rooms[0] > 1
    if level.locked:
        locked = rng.choice([r for r in receptacles if r.is_container])
        others = [r for r in receptacles if r.room != locked.room]
        if rng.random() < 0.5:
            return locked, rng.choice(others), locked
        return rng.choice(others), locked, locked
    destination = rng.choice(receptacles)
    sources = [r for r in receptacles if r != destination and not (multi_room and r.room == destination.room)]
    return rng.choice(sources), destination, None


# ---------------------------------------------------------------------------------------------------
# Transitions


def apply_action(world: World, state: State, command: str) -> Outcome:
    """Apply one command; failures leave the state unchanged and set ``invalid``."""
    match normalize_command(command).split():
        case ["look"]:
            return Outcome(state, "You look around.", invalid=False)
        case ["inventory"]:
            held = state.held()
            return Outcome(state, f"You carry: {', '.join(held)}." if held else "You carry nothing.", invalid=False)
        case ["go", "to", room]:
            return _go(world, state, room)
        case ["take", obj]:
            return _take(world, state, obj, None)
        case ["take", obj, "from", place]:
            return _take(world, state, obj, place)
        case ["put", obj, ("in" | "on") as preposition, place]:
            return _put(world, state, obj, preposition, place)
        case ["open", name]:
            return _open(world, state, name)
        case ["close", name]:
            return _close(world, state, name)
        case ["unlock", name, "with", tool]:
            return _unlock(world, state, name, tool)
        case ["examine", name]:
            return _examine(world, state, name)
    return _fail(state, "Nothing happens.")


def _fail(state: State, feedback: str) -> Outcome:
    return Outcome(state, feedback, invalid=True)


def _here(world: World, state: State, name: str) -> Optional[Receptacle]:
    receptacle = world.receptacle(name)
    return receptacle if receptacle is not None and receptacle.room == state.room else None


def visible_objects(world: World, state: State) -> list[str]:
    """Objects the agent can take now (on a surface or in an open container in this room), sorted."""
    return sorted(obj for obj, place in state.locations
                  if _here(world, state, place) is not None and state.status(place) == OPEN)


def _go(world: World, state: State, room: str) -> Outcome:
    if room == state.room:
        return _fail(state, f"You are already in the {room}.")
    if room not in world.neighbours(state.room):
        return _fail(state, f"You can't go to the {room} from here.")
    return Outcome(state.in_room(room), f"You go to the {room}.", invalid=False)


def _take(world: World, state: State, obj: str, place: Optional[str]) -> Outcome:
    if world.receptacle(obj) is not None:
        return _fail(state, f"You can't take the {obj}.")
    if obj in world.objects and state.where(obj) == INVENTORY:
        return _fail(state, f"You already have the {obj}.")
    if obj not in visible_objects(world, state):
        return _fail(state, f"You can't see any {obj} here.")
    source = world.receptacle(state.where(obj))
    assert source is not None
    if place is not None and place != source.name:
        return _fail(state, f"The {obj} is not {source.preposition} the {place}.")
    return Outcome(state.moved(obj, INVENTORY), f"You take the {obj}.", invalid=False)


def _put(world: World, state: State, obj: str, preposition: str, place: str) -> Outcome:
    if obj not in state.held():
        return _fail(state, f"You don't have the {obj}.")
    receptacle = _here(world, state, place)
    if receptacle is None:
        return _fail(state, f"You can't see any {place} here.")
    if preposition != receptacle.preposition:
        return _fail(state, f"You can put things {receptacle.preposition} the {place}, not {preposition} it.")
    if state.status(place) != OPEN:
        return _fail(state, f"The {place} is {state.status(place)}.")
    return Outcome(state.moved(obj, place), f"You put the {obj} {preposition} the {place}.", invalid=False)


def _open(world: World, state: State, name: str) -> Outcome:
    receptacle = _here(world, state, name)
    if receptacle is None:
        return _fail(state, f"You can't see any {name} here.")
    if not receptacle.is_container:
        return _fail(state, f"You can't open the {name}.")
    if state.status(name) == OPEN:
        return _fail(state, f"The {name} is already open.")
    if state.status(name) == LOCKED:
        return _fail(state, f"The {name} is locked.")
    return Outcome(state.with_status(name, OPEN), f"You open the {name}.", invalid=False)


def _close(world: World, state: State, name: str) -> Outcome:
    receptacle = _here(world, state, name)
    if receptacle is None:
        return _fail(state, f"You can't see any {name} here.")
    if not receptacle.is_container:
        return _fail(state, f"You can't close the {name}.")
    if state.status(name) != OPEN:
        return _fail(state, f"The {name} is already closed.")
    return Outcome(state.with_status(name, CLOSED), f"You close the {name}.", invalid=False)


def _unlock(world: World, state: State, name: str, tool: str) -> Outcome:
    receptacle = _here(world, state, name)
    if receptacle is None:
        return _fail(state, f"You can't see any {name} here.")
    if state.status(name) != LOCKED:
        return _fail(state, f"The {name} is not locked.")
    if tool not in state.held():
        return _fail(state, f"You don't have the {tool}.")
    if tool != KEY:
        return _fail(state, f"The {tool} doesn't fit the lock.")
    return Outcome(state.with_status(name, CLOSED), f"You unlock the {name} with the {KEY}.", invalid=False)


def _examine(world: World, state: State, name: str) -> Outcome:
    receptacle = _here(world, state, name)
    if receptacle is not None:
        return Outcome(state, _receptacle_text(state, receptacle), invalid=False)
    if name in state.held():
        return Outcome(state, f"You are carrying the {name}.", invalid=False)
    if name in visible_objects(world, state):
        source = world.receptacle(state.where(name))
        assert source is not None
        return Outcome(state, f"The {name} is {source.preposition} the {source.name}.", invalid=False)
    return _fail(state, f"You can't see any {name} here.")


def goal_reached(world: World, state: State) -> bool:
    return state.where(world.goal_object) == world.goal_receptacle


def admissible_actions(world: World, state: State) -> list[str]:
    """Every command that succeeds in ``state``, sorted; bounded by the level's world size."""
    actions = ["look", "inventory"] + [f"go to {room}" for room in world.neighbours(state.room)]
    visible = visible_objects(world, state)
    actions += [f"take {obj}" for obj in visible]
    actions += [f"examine {obj}" for obj in visible + state.held()]
    for receptacle in world.receptacles_in(state.room):
        name, status = receptacle.name, state.status(receptacle.name)
        actions.append(f"examine {name}")
        if status == OPEN:
            actions += [f"put {obj} {receptacle.preposition} {name}" for obj in state.held()]
        if receptacle.is_container and status == OPEN:
            actions.append(f"close {name}")
        elif status == CLOSED:
            actions.append(f"open {name}")
        elif status == LOCKED and KEY in state.held():
            actions.append(f"unlock {name} with {KEY}")
    return sorted(actions)


# ---------------------------------------------------------------------------------------------------
# Text


def _receptacle_text(state: State, receptacle: Receptacle) -> str:
    status = state.status(receptacle.name)
    if status != OPEN:
        return f"The {receptacle.name} is {status}."
    contents = sorted(state.contents(receptacle.name))
    if not contents:
        return f"The {receptacle.name} is empty."
    return f"{receptacle.preposition.capitalize()} the {receptacle.name}: {', '.join(contents)}."


def describe(world: World, state: State) -> str:
    """What the agent sees: room, exits, receptacles with their contents, what it carries."""
    parts = [f"You are in the {state.room}."]
    exits = world.neighbours(state.room)
    if exits:
        parts.append(f"Exits: {', '.join(exits)}.")
    parts += [_receptacle_text(state, r) for r in world.receptacles_in(state.room)]
    held = sorted(state.held())
    if held:
        parts.append(f"You carry: {', '.join(held)}.")
    return " ".join(parts)


def observation(world: World, state: State, first_line: str, goal_reminder: bool = False) -> str:
    """``first_line`` (the task or the feedback), the view and the valid actions; with
    ``goal_reminder``, a last line restating the goal."""
    lines = [first_line, describe(world, state), f"Valid actions: {', '.join(admissible_actions(world, state))}."]
    if goal_reminder:
        lines.append(f"Goal: {world.goal_text}.")
    return "\n".join(lines)


def first_observation(world: World, goal_reminder: bool = False) -> str:
    return observation(world, world.start, f"Your task: {world.goal_text}.", goal_reminder)


# ---------------------------------------------------------------------------------------------------
# Optimal planning


def _route(world: World, start: str, end: str) -> list[str]:
    """Rooms entered on a shortest walk from ``start`` to ``end`` (breadth-first over exits)."""
    previous: dict[str, Optional[str]] = {start: None}
    frontier = deque([start])
    while frontier:
        room = frontier.popleft()
        for nxt in world.neighbours(room):
            if nxt not in previous:
                previous[nxt] = room
                frontier.append(nxt)
    path: list[str] = []
    room: Optional[str] = end
    while room != start:
        assert room is not None, f"no route from {start} to {end}"
        path.append(room)
        room = previous[room]
    return path[::-1]


def _stop_orders(world: World, state: State) -> list[list[tuple[str, str]]]:
    """Feasible orders of the (verb, object) stops still needed; the delivery always comes last."""
    goal = world.goal_object
    fetch_goal = [] if state.where(goal) == INVENTORY else [("take", goal)]
    deliver = [("put", goal)]
    locked = {c for c, s in state.container_status if s == LOCKED}
    needs_key = KEY not in state.held() and bool(locked & {state.where(goal), world.goal_receptacle})
    if not needs_key:
        return [fetch_goal + deliver]
    fetch_key = [("take", KEY)]
    if state.where(goal) in locked:
        return [fetch_key + fetch_goal + deliver]
    return [fetch_key + fetch_goal + deliver, fetch_goal + fetch_key + deliver]


def _walk(world: World, state: State, stops: list[tuple[str, str]]) -> list[str]:
    """Commands visiting ``stops`` in order: shortest routes, then only the unlock/open each stop needs."""
    plan: list[str] = []
    for verb, obj in stops:
        place = world.goal_receptacle if verb == "put" else state.where(obj)
        receptacle = world.receptacle(place)
        assert receptacle is not None
        commands = [f"go to {room}" for room in _route(world, state.room, receptacle.room)]
        if state.status(place) == LOCKED:
            commands.append(f"unlock {place} with {KEY}")
        if state.status(place) != OPEN:
            commands.append(f"open {place}")
        commands.append(f"take {obj}" if verb == "take" else f"put {obj} {receptacle.preposition} {place}")
        for command in commands:
            outcome = apply_action(world, state, command)
            assert not outcome.invalid, f"planner produced an invalid command {command!r}: {outcome.feedback}"
            state = outcome.state
        plan += commands
    return plan


@lru_cache(maxsize=65536)
def shortest_plan(world: World, state: State) -> tuple[str, ...]:
    """A shortest command sequence from ``state`` to the goal (empty when the goal holds)."""
    if goal_reached(world, state):
        return ()
    plans = [_walk(world, state, stops) for stops in _stop_orders(world, state)]
    return tuple(min(plans, key=len))


# ---------------------------------------------------------------------------------------------------
# Task-level API


def world_of(task: Task) -> World:
    """The world a task was generated from (``task.data`` holds the seed and difficulty)."""
    return generate_world(int(task.data["seed"]), int(task.data["difficulty"]))


def make_task(seed: int, difficulty: int, goal_reminder: bool = False) -> Task:
    world = generate_world(seed, difficulty)
    return Task(
        task_id=f"procedural-d{difficulty}-{seed}",
        prompt=first_observation(world, goal_reminder),
        data={"seed": seed, "difficulty": difficulty},
    )


def replay(world: World, actions: list[str]) -> State:
    """The state after applying ``actions`` from the start."""
    state = world.start
    for action in actions:
        state = apply_action(world, state, action).state
    return state


def expert_plan(task: Task) -> list[str]:
    """The scripted optimal expert: a shortest command sequence solving ``task``."""
    world = world_of(task)
    return list(shortest_plan(world, world.start))


def optimal_distance(task: Task, actions_prefix: list[str]) -> int:
    """Number of actions a shortest plan needs after ``actions_prefix`` has been played."""
    world = world_of(task)
    return len(shortest_plan(world, replay(world, actions_prefix)))


def diagnose(task: Task, actions: list[str], feedbacks: Optional[list[str]] = None) -> dict[str, Any]:
    """A scripted reflection in the R³L JSON format.

    ``retry_from_step`` (0-based) is the first step after which the optimal distance to the goal did
    not drop by one; 0 for an optimal success, ``len(actions)`` for a failure whose actions were all
    optimal (it stopped early). ``feedbacks`` are the environment's feedback per step, quoted when a
    step failed; the world is deterministic, so they are recomputed when omitted. Steps after the goal
    is reached are ignored.
    """
    if feedbacks is not None and len(feedbacks) != len(actions):
        raise ValueError(f"diagnose: {len(feedbacks)} feedbacks for {len(actions)} actions")
    world = world_of(task)
    state = world.start
    shortest = len(shortest_plan(world, state))
    pivot: Optional[tuple[int, State, Outcome]] = None
    invalid = 0
    steps = 0
    for step, action in enumerate(actions):
        outcome = apply_action(world, state, action)
        invalid += outcome.invalid
        progressed = len(shortest_plan(world, outcome.state)) == len(shortest_plan(world, state)) - 1
        if pivot is None and not progressed:
            pivot = (step, state, outcome)
        state, steps = outcome.state, step + 1
        if goal_reached(world, state):
            break
    success = goal_reached(world, state)
    # Short and regular: a tiny policy learns to write it back in the warm-start.
    summary = f"{steps} actions ({invalid} invalid), {'succeeded' if success else 'failed'}; the shortest plan has {shortest}."
    if pivot is None and success:
        return _reflection(summary, "Every action was on a shortest path to the goal.", "success",
                           "Repeat the same plan.", 0)
    outcome_label = "success_but_inefficient" if success else "failure"
    if pivot is None:
        remaining = shortest_plan(world, state)
        cause = (f"All {steps} actions were on a shortest path, but the episode ended "
                 f"{len(remaining)} actions short of the goal.")
        return _reflection(summary, cause, outcome_label, f"Continue with '{remaining[0]}'.", steps)
    step, before, outcome = pivot
    action = normalize_command(actions[step])
    feedback = feedbacks[step] if feedbacks is not None else outcome.feedback
    remaining = shortest_plan(world, before)
    suggestion = (
        f"At step {step}, do '{remaining[0]}' instead of '{action}'. "
        f"From there the task needs {len(remaining)} actions."
    )
    return _reflection(summary, _root_cause(world, before, step, action, outcome, feedback), outcome_label,
                       suggestion, step)


def _reflection(summary: str, cause: str, outcome: str, suggestion: str, retry_from_step: int) -> dict[str, Any]:
    return {
        "trajectory_summary": summary,
        "root_cause_analysis": cause,
        "trajectory_outcome": outcome,
        "improvement_suggestion": suggestion,
        "retry_from_step": retry_from_step,
    }


def _root_cause(world: World, state: State, step: int, action: str, outcome: Outcome, feedback: str) -> str:
    """One sentence saying why ``action`` at ``step`` left the shortest path."""
    words = action.split()
    if outcome.invalid:
        target = words[1] if len(words) > 1 and words[0] == "take" else ""
        if target in world.objects and state.where(target) != INVENTORY and target not in visible_objects(world, state):
            reason = _whereabouts(world, state, target)
        else:
            reason = f"the game answered \"{feedback}\""
        return f"At step {step} you tried '{action}', but {reason}."
    if words[0] in INFO_VERBS:
        return f"At step {step} you used '{action}', which reveals nothing new and wastes a turn."
    if words[0] == "take":
        return f"At step {step} you took the {words[1]}, which the task does not need."
    if words[0] == "go":
        return f"At step {step} you went to the {words[2]}, away from where you needed to be."
    return f"At step {step} you did '{action}', which does not bring you closer to the goal."


def _whereabouts(world: World, state: State, obj: str) -> str:
    """Where a hidden object is, e.g. "the key is in the closed drawer" or "... on the desk in the study"."""
    receptacle = world.receptacle(state.where(obj))
    assert receptacle is not None
    if receptacle.room != state.room:
        return f"the {obj} is {receptacle.preposition} the {receptacle.name} in the {receptacle.room}"
    return f"the {obj} is in the {state.status(receptacle.name)} {receptacle.name}"


# ---------------------------------------------------------------------------------------------------
# Environment and suite


class ProceduralWorldEnv:
    """One episode of a procedural world at a time (see the module docstring for the rules)."""

    def __init__(self, max_turns: int, goal_reminder: bool = False) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.goal_reminder = goal_reminder
        self._world: Optional[World] = None
        self._state: Optional[State] = None
        self._turns = 0
        self._done = True

    def reset(self, task: Task) -> str:
        self._world = world_of(task)
        self._state = self._world.start
        self._turns = 0
        self._done = False
        return first_observation(self._world, self.goal_reminder)

    def step(self, action: str) -> StepResult:
        if self._done or self._world is None or self._state is None:
            raise RuntimeError("ProceduralWorldEnv.step called before reset or after the episode ended")
        world = self._world
        outcome = apply_action(world, self._state, action)
        self._state = outcome.state
        self._turns += 1
        success = goal_reached(world, outcome.state)
        self._done = success or self._turns >= self.max_turns
        if success:
            text = f"{outcome.feedback}\nTask complete."
        elif self._done:
            text = f"{outcome.feedback}\nYou have run out of turns."
        else:
            text = observation(world, outcome.state, outcome.feedback, self.goal_reminder)
        info = {
            "feedback": outcome.feedback,
            "success": success,
            "admissible_actions": [] if self._done else admissible_actions(world, outcome.state),
            "invalid_action": outcome.invalid,
        }
        return StepResult(observation=text, reward=1.0 if success else 0.0, done=self._done, info=info)


class ProceduralWorldSuite(TaskSuite):
    """Procedurally generated household tasks (the CPU quickstart's training world)."""

    def __init__(
        self,
        difficulty: int = 1,
        max_turns: Optional[int] = None,
        num_val_tasks: int = 64,
        seed: int = 0,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        goal_reminder: bool = False,
    ) -> None:
        """
        Args:
            difficulty: 1 (one room, open containers) to 4 (several rooms, a locked container and its
                key); see the module docstring.
            max_turns: episode step limit; None uses ``DEFAULT_MAX_TURNS[difficulty]`` (at least twice
                the longest expert plan of the level).
            num_val_tasks: number of held-out validation tasks.
            seed: suite seed; every task is a pure function of (seed, difficulty, split, index).
            system_prompt: system message of every conversation.
            goal_reminder: end every observation with a ``Goal: ...`` line. The goal then sits at a
                fixed distance before each action the policy writes, which tiny models pick up in
                ~150 SFT steps (a 2-layer model copies the object from a goal stated only in the first
                message far more slowly: 0% success after 250 steps on the quickstart's setup).
        """
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty}")
        if num_val_tasks < 0:
            raise ValueError(f"num_val_tasks must be >= 0, got {num_val_tasks}")
        self.difficulty = difficulty
        self.max_turns = DEFAULT_MAX_TURNS[difficulty] if max_turns is None else max_turns
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.num_val_tasks = num_val_tasks
        self.seed = seed
        self.system_prompt = system_prompt
        self.goal_reminder = goal_reminder

    def make_env(self) -> ProceduralWorldEnv:
        return ProceduralWorldEnv(self.max_turns, self.goal_reminder)

    def train_task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"train_task index must be >= 0, got {index}")
        return make_task(split_seed(self.seed, "train", index, bits=56), self.difficulty, self.goal_reminder)

    def val_tasks(self) -> list[Task]:
        return list(self._val_task_list)

    def demonstration(self, task: Task) -> list[str]:
        return expert_plan(task)

    def diagnose(self, task: Task, actions: list[str], feedbacks: Optional[list[str]] = None) -> dict[str, Any]:
        return diagnose(task, actions, feedbacks)

    def expert_continuation(self, task: Task, prefix_actions: list[str]) -> list[str]:
        world = world_of(task)
        return list(shortest_plan(world, replay(world, prefix_actions)))

    @cached_property
    def _val_task_list(self) -> list[Task]:
        return [
            make_task(split_seed(self.seed, "val", i, bits=56), self.difficulty, self.goal_reminder)
            for i in range(self.num_val_tasks)
        ]
