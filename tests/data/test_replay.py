import random

import pytest
import torch

from r3lightning.data.replay import TRAJECTORY_OVERHEAD_BYTES, ReplayBuffer
from r3lightning.types import GuidedTurn, Trajectory, Turn


def make(task_id: str, tag: str, success: bool = False, num_response: int = 2, version: int = 0) -> Trajectory:
    turns = [
        Turn(context_ids=[1, 2, 3], response_ids=list(range(10, 10 + num_response)),
             logprobs=[-0.5] * num_response, feedback="wrong", action="go north", observation="a room"),
        Turn(context_ids=[4], response_ids=[5, 6], logprobs=None, trainable=False),
    ]
    return Trajectory(task_id=task_id, turns=turns, reward=float(success), success=success, origin="in_context",
                      model_version=version, end_reason="done", guided_turn=GuidedTurn(index=0, unguided_context=[1, 2]),
                      info={"tag": tag, "span": (0, [1, 2])})


def contents(buffer: ReplayBuffer) -> list[tuple[str, str, int]]:
    """(task, tag, step) of every stored trajectory, oldest first."""
    return [(e["trajectory"]["task_id"], e["trajectory"]["info"]["tag"], e["step"]) for e in buffer.state_dict()["entries"]]


def test_per_task_bound_evicts_that_tasks_oldest():
    buffer = ReplayBuffer(max_per_task=2, max_total=100)
    for step, (task, tag) in enumerate([("a", "a0"), ("b", "b0"), ("a", "a1"), ("a", "a2")]):
        buffer.add(make(task, tag), step)
    assert contents(buffer) == [("b", "b0", 1), ("a", "a1", 2), ("a", "a2", 3)]
    assert len(buffer) == 3


def test_total_bound_evicts_globally_oldest():
    buffer = ReplayBuffer(max_per_task=10, max_total=3)
    for step, (task, tag) in enumerate([("a", "a0"), ("b", "b0"), ("a", "a1"), ("c", "c0")]):
        buffer.add(make(task, tag), step)
    assert contents(buffer) == [("b", "b0", 1), ("a", "a1", 2), ("c", "c0", 3)]
    buffer.add(make("a", "a2"), 4)
    assert contents(buffer) == [("a", "a1", 2), ("c", "c0", 3), ("a", "a2", 4)]
    assert buffer.tasks_with_history() == ["a", "c"]


def test_per_task_eviction_comes_before_global_eviction():
    # b0 is globally oldest, but the task bound already makes room: only a0 goes.
    buffer = ReplayBuffer(max_per_task=2, max_total=3)
    for step, (task, tag) in enumerate([("b", "b0"), ("a", "a0"), ("a", "a1"), ("a", "a2")]):
        buffer.add(make(task, tag), step)
    assert contents(buffer) == [("b", "b0", 0), ("a", "a1", 2), ("a", "a2", 3)]


def test_sample_returns_requested_outcome_at_most_k_deterministically():
    buffer = ReplayBuffer(max_per_task=10, max_total=100)
    for i in range(6):
        buffer.add(make("a", f"a{i}", success=i % 2 == 0), step=10 + i)
    buffer.add(make("b", "b0", success=True), step=20)

    wins = buffer.sample("a", want_success=True, k=2, rng=random.Random(0))
    assert len(wins) == 2
    assert all(t.success and t.task_id == "a" for t, _ in wins)
    assert all(step == 10 + int(t.info["tag"][1:]) for t, step in wins)
    again = buffer.sample("a", want_success=True, k=2, rng=random.Random(0))
    assert [(t.info["tag"], s) for t, s in again] == [(t.info["tag"], s) for t, s in wins]

    losses = buffer.sample("a", want_success=False, k=10, rng=random.Random(1))
    assert sorted(t.info["tag"] for t, _ in losses) == ["a1", "a3", "a5"]
    assert buffer.sample("b", want_success=False, k=3, rng=random.Random(0)) == []
    assert buffer.sample("unseen", want_success=True, k=3, rng=random.Random(0)) == []
    assert buffer.sample("a", want_success=True, k=0, rng=random.Random(0)) == []
    with pytest.raises(ValueError, match="k must be >= 0"):
        buffer.sample("a", want_success=True, k=-1, rng=random.Random(0))


def test_stored_and_sampled_trajectories_are_copies():
    buffer = ReplayBuffer(max_per_task=4, max_total=4)
    original = make("a", "a0", success=True, version=7)
    buffer.add(original, step=3)
    expected = make("a", "a0", success=True, version=7)

    original.turns[0].response_ids.append(99)
    original.turns[0].logprobs.append(-1.0)
    original.info["tag"] = "changed"
    original.info["span"][1].append(3)
    original.reward = -5.0
    original.guided_turn.unguided_context.append(9)
    (stored, step), = buffer.sample("a", want_success=True, k=1, rng=random.Random(0))
    assert stored == expected and step == 3

    stored.turns[1].context_ids.append(42)
    stored.origin = "replay"
    (again, _), = buffer.sample("a", want_success=True, k=1, rng=random.Random(0))
    assert again == expected


def test_add_rejects_values_a_checkpoint_cannot_hold():
    trajectory = make("a", "a0")
    trajectory.info["engine"] = object()
    buffer = ReplayBuffer(max_per_task=2, max_total=2)
    with pytest.raises(ValueError, match=r"Trajectory\.info\['engine'\] \(object\)"):
        buffer.add(trajectory, step=0)
    assert len(buffer) == 0


def test_recent_failures():
    buffer = ReplayBuffer(max_per_task=2, max_total=2, max_visits=4)
    assert not buffer.recent_failures("a", 2)
    buffer.record_visit("a", False)
    assert buffer.recent_failures("a", 1) and not buffer.recent_failures("a", 2)
    buffer.record_visit("a", False)
    assert buffer.recent_failures("a", 2)
    buffer.record_visit("a", True)
    assert not buffer.recent_failures("a", 1)
    for _ in range(4):
        buffer.record_visit("a", False)
    # the success fell out of the bounded history
    assert buffer.recent_failures("a", 4)
    assert not buffer.recent_failures("b", 1)
    with pytest.raises(ValueError, match="max_visits=4"):
        buffer.recent_failures("a", 5)


def test_num_bytes_grows_and_shrinks_with_contents():
    buffer = ReplayBuffer(max_per_task=1, max_total=10)
    assert buffer.num_bytes() == 0
    buffer.add(make("a", "a0", num_response=2), step=0)
    small = buffer.num_bytes()
    assert small > TRAJECTORY_OVERHEAD_BYTES
    # 10 more response tokens with their 10 log-probs: 20 numbers of 8 bytes
    buffer.add(make("b", "b0", num_response=12), step=1)
    assert buffer.num_bytes() == small + small + 160
    # per-task eviction replaces the long trajectory by a short one
    buffer.add(make("b", "b1", num_response=2), step=2)
    assert buffer.num_bytes() == 2 * small


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return type(value) in (int, float, str, bool, type(None))


def _round_trip(buffer: ReplayBuffer, tmp_path) -> ReplayBuffer:
    path = tmp_path / "replay.pt"
    torch.save({"replay": buffer.state_dict()}, path)
    restored = ReplayBuffer(buffer.max_per_task, buffer.max_total, buffer.max_visits)
    restored.load_state_dict(torch.load(path, weights_only=True)["replay"])
    return restored


def test_state_dict_round_trip_restores_contents_and_future_evictions(tmp_path):
    buffer = ReplayBuffer(max_per_task=2, max_total=4, max_visits=3)
    for step, (task, tag, success) in enumerate([("a", "a0", True), ("b", "b0", False), ("a", "a1", False),
                                                 ("c", "c0", True), ("a", "a2", True)]):
        buffer.add(make(task, tag, success=success, version=step), step)
        buffer.record_visit(task, success)
    assert _is_plain(buffer.state_dict())

    restored = _round_trip(buffer, tmp_path)
    assert restored.state_dict() == buffer.state_dict()
    assert restored.num_bytes() == buffer.num_bytes() and len(restored) == len(buffer)
    for step, (task, tag, success) in enumerate([("d", "d0", False), ("b", "b1", True), ("a", "a3", False)], 10):
        for b in (buffer, restored):
            b.add(make(task, tag, success=success), step)
            b.record_visit(task, success)
        assert contents(restored) == contents(buffer)
    assert restored.state_dict() == buffer.state_dict()
    for task in ("a", "b", "c", "d"):
        for want in (True, False):
            mine = buffer.sample(task, want, 2, random.Random(5))
            theirs = restored.sample(task, want, 2, random.Random(5))
            assert mine == theirs
        assert restored.recent_failures(task, 1) == buffer.recent_failures(task, 1)


def test_load_into_smaller_buffer_keeps_the_newest(tmp_path):
    buffer = ReplayBuffer(max_per_task=3, max_total=6)
    for step, task in enumerate("aabbab"):
        buffer.add(make(task, f"{task}{step}"), step)
    smaller = ReplayBuffer(max_per_task=2, max_total=3)
    smaller.load_state_dict(buffer.state_dict())
    assert contents(smaller) == [("b", "b3", 3), ("a", "a4", 4), ("b", "b5", 5)]


@pytest.mark.parametrize("name", ["max_per_task", "max_total", "max_visits"])
def test_bounds_must_be_positive(name):
    kwargs = {"max_per_task": 1, "max_total": 1, "max_visits": 1, name: 0}
    with pytest.raises(ValueError, match=name):
        ReplayBuffer(**kwargs)
