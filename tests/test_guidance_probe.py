"""experiments/guidance_probe.py: the probes it builds (three guidances per pivot, the alternative an
admissible action that is neither the expert's nor the mistake) and the rates it reports."""

import random

from r3lightning.envs.textworld_procedural import admissible_actions, replay, world_of
from r3lightning.rollout.explorers.reflection import Reflector, load_template
from r3lightning.types import Trajectory, Turn


class _ScriptedLoop:
    """Plays fixed actions into turns (all the probe asks of the agent loop)."""

    def play_actions(self, requests, actions, allow_unfinished=False):
        return [Trajectory(r.task.task_id, [Turn([1], [2], action=a) for a in acts]) for r, acts in zip(requests, actions)]


def test_each_pivot_gets_expert_alternative_and_no_guidance(world_suite):
    from experiments.guidance_probe import probe_requests

    reflector = Reflector(1.0, 192, load_template("", "reflection.txt"), load_template("", "guidance.txt"))
    tasks = [world_suite.train_task(i) for i in range(4)]
    requests, probes, skipped = probe_requests(world_suite, _ScriptedLoop(), reflector, tasks, random.Random(0))
    assert len(requests) == 3 * len(probes) and probes
    assert len(probes) + skipped == sum(len(world_suite.demonstration(t)) for t in tasks)
    for i, probe in enumerate(probes):
        expert, alternative, none = requests[3 * i: 3 * i + 3]
        task = expert.task
        assert task.task_id == probe["task"] and len(expert.prefix) == probe["k"] == len(none.prefix)
        assert [t.action for t in expert.prefix] == world_suite.demonstration(task)[: probe["k"]]
        assert f"'{probe['expert']}'" in expert.guidance and f"'{probe['mistake']}'" in expert.guidance
        assert f"'{probe['alternative']}'" in alternative.guidance and f"'{probe['expert']}'" not in alternative.guidance
        assert none.guidance is None
        world = world_of(task)
        assert probe["alternative"] in admissible_actions(world, replay(world, world_suite.demonstration(task)[: probe["k"]]))
        assert probe["alternative"] not in (probe["expert"], probe["mistake"])


def test_follow_rates_count_the_named_action_per_guidance():
    from experiments.guidance_probe import follow_rates

    probes = [
        {"expert": "take a", "alternative": "open b", "action_expert": "take a", "action_alternative": "open b",
         "action_none": "take a", "success_expert": True, "success_none": True},
        {"expert": "take a", "alternative": "open b", "action_expert": "look", "action_alternative": "take a",
         "action_none": "open b", "success_expert": False, "success_none": False},
    ]
    rates = follow_rates(probes)
    assert rates["expert_followed"] == 0.5 and rates["alternative_followed"] == 0.5
    assert rates["unguided_takes_expert"] == 0.5 and rates["unguided_takes_alternative"] == 0.5
    assert rates["alternative_guidance_takes_expert"] == 0.5
    assert rates["success_expert_guidance"] == 0.5 and rates["success_unguided"] == 0.5
