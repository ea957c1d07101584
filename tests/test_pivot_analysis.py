"""experiments/pivot_analysis.py's retry record: what a retry did at its pivot against the suggestion
of its base's reflection (followed or not, on a shortest path after it, success)."""

import json

from r3lightning.envs.textworld_procedural import shortest_plan, world_of
from r3lightning.types import Trajectory, Turn


def _trajectory(actions: list[str], success: bool, **fields) -> Trajectory:
    return Trajectory("t", [Turn([1], [2], action=a) for a in actions], reward=float(success), success=success, **fields)


def test_a_retry_that_takes_the_suggested_action_and_finishes_is_followed_and_on_path(world_suite):
    from experiments.pivot_analysis import retry_record, summarize_retries

    task = world_suite.train_task(0)
    plan = list(shortest_plan(world_of(task), world_of(task).start))
    assert len(plan) >= 2
    reflection = json.dumps({
        "trajectory_summary": "s", "root_cause_analysis": "c", "trajectory_outcome": "failure",
        "improvement_suggestion": f"At step 1, do '{plan[1]}' instead of 'look'.", "retry_from_step": 1,
    })
    base = _trajectory([plan[0], "look", "look"], False, info={"reflection": reflection})
    followed = retry_record(3, task, base, _trajectory(plan, True, origin="distilled", pivot=1))
    assert followed["followed"] and followed["on_shortest_path_after_pivot"] and followed["retry_success"]
    assert followed["suggested"] == plan[1] and followed["remaining_plan"] == len(plan) - 1
    ignored = retry_record(3, task, base, _trajectory([plan[0], "look"], False, origin="distilled", pivot=1))
    assert not ignored["followed"] and not ignored["on_shortest_path_after_pivot"]
    summary = summarize_retries([followed, ignored])
    assert summary["guidance_followed_rate"] == 0.5 and summary["retry_success_rate_when_followed"] == 1.0
    assert summary["retry_success_rate_when_not_followed"] == 0.0
