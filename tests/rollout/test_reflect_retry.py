"""R³L: reflection parsing, retry from the pivot, context distillation, meta-tasks, pivotal credit."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_engine import ScriptedEngine, expert_action, scripted_arithmetic, world_player

from r3lightning.data.collate import collate_experience
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.rollout.agent_loop import AgentLoop
from r3lightning.engines.base import SamplingParams
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer, distill
from r3lightning.rollout.explorers.reflection import parse_reflection
from r3lightning.engines.hf.engine import HFEngine

VALID = {
    "trajectory_summary": "s",
    "root_cause_analysis": "r",
    "trajectory_outcome": "failure",
    "improvement_suggestion": "i",
    "retry_from_step": 1,
}


def test_parse_valid_with_surrounding_text_and_coercion():
    text = "Sure! " + json.dumps({**VALID, "retry_from_step": "2"}) + " hope it helps"
    reflection, reason = parse_reflection(text, num_turns=3)
    assert reason == "" and reflection.retry_from_step == 2
    assert parse_reflection(json.dumps({**VALID, "retry_from_step": 1.0}), 3)[0].retry_from_step == 1


def test_parse_rejections_name_the_reason():
    cases = {
        "no json here": "no_json",
        "{not json}": "bad_json",
        json.dumps({k: v for k, v in VALID.items() if k != "root_cause_analysis"}): "missing_field",
        json.dumps({**VALID, "trajectory_outcome": "meh"}): "bad_outcome",
        json.dumps({**VALID, "retry_from_step": 3}): "step_out_of_range",
        json.dumps({**VALID, "retry_from_step": -1}): "step_out_of_range",
        json.dumps({**VALID, "retry_from_step": 1.5}): "wrong_type",
        json.dumps({**VALID, "retry_from_step": True}): "wrong_type",
        json.dumps({**VALID, "retry_from_step": "two"}): "wrong_type",
        json.dumps({**VALID, "improvement_suggestion": 7}): "wrong_type",
        json.dumps([VALID]): "",  # first "{" to last "}" is the inner object: accepted
    }
    for text, reason in cases.items():
        reflection, got = parse_reflection(text, num_turns=3)
        assert got == reason and (reflection is None) == bool(reason), text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.integers(min_value=0, max_value=10))
def test_parse_never_raises_on_arbitrary_text(text, turns):
    reflection, reason = parse_reflection(text, turns)
    assert (reflection is None) == bool(reason)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={k: json_values for k in VALID}), st.integers(min_value=0, max_value=6))
def test_parse_never_raises_on_fuzzed_fields(fields, turns):
    reflection, _ = parse_reflection("x" + json.dumps(fields) + "y", turns)
    if reflection is not None:
        assert 0 <= reflection.retry_from_step < max(turns, 1)
        assert isinstance(reflection.retry_from_step, int)


class ScriptedReflectionEngine(ScriptedEngine):
    """Answers reflection prompts with a fixed JSON and game turns with fixed actions; subclasses
    script other replies by overriding ``reply``."""

    def __init__(self, tokenizer, reflection, action="look"):
        super().__init__(tokenizer, self.reply)
        self.reflection, self.action = reflection, action

    def reply(self, text):
        return self.reflection if "Review this attempt" in text else f"<action>{self.action}</action>"


def test_explorer_retries_from_pivot_and_distills_without_guidance(world_suite, world_tokenizer):
    reflection = json.dumps({**VALID, "improvement_suggestion": "GUIDANCE-MARKER", "retry_from_step": 1})
    engine = ScriptedReflectionEngine(world_tokenizer, reflection)
    loop = AgentLoop(world_suite, engine, world_tokenizer)
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    out = ReflectRetryExplorer().explore(tasks, loop, ExplorationSpec(4, SamplingParams()))
    assert [len(g) for g in out.groups] == [4, 4]  # 2 base + 2 distilled per task
    for group in out.groups:
        base = [t for t in group if t.origin == "base"]
        distilled = [t for t in group if t.origin == "distilled"]
        assert len(base) == 2 and len(distilled) == 2
        for b, d in zip(base, distilled):
            assert b.pivot == d.pivot == 1
            assert d.turns[0] is b.turns[0]  # the replayed prefix keeps its original tokens
            text = world_tokenizer.decode(d.token_ids())
            assert "GUIDANCE-MARKER" not in text and "Guidance" not in text
            assert text.count("<|im_start|>user") == len(d.turns)  # one observation per turn: the pivot's shown once
            assert d.turns[1].context_ids == b.turns[1].context_ids  # and exactly as the base saw it
    assert out.metrics["rollout/reflection_invalid_rate"] == 0.0
    assert out.metrics["rollout/reflection_outcome_agreement"] == 1.0  # "failure", and "look" does fail
    assert out.metrics["rollout/pivot_position"] == 0.25
    assert out.metrics["rollout/retry_tokens_saved"] > 0
    assert out.sft == []  # a "look" retry never improves: no meta-tasks


def test_pivotal_mask_on_base_distilled_pair(world_suite, world_tokenizer):
    reflection = json.dumps({**VALID, "retry_from_step": 2})
    loop = AgentLoop(world_suite, ScriptedReflectionEngine(world_tokenizer, reflection), world_tokenizer)
    out = ReflectRetryExplorer().explore([world_suite.train_task(0)], loop, ExplorationSpec(2, SamplingParams()))
    base, distilled = out.groups[0].trajectories
    batch = collate_experience([base, distilled], [1.0, 1.0], world_tokenizer.pad_token_id, pivotal_credit=True)
    for row in range(2):
        trained = batch.turn_index[row][batch.loss_mask[row].bool()]
        assert trained.min() == 2 and set(trained.tolist()) == {2, 3}
    plain = collate_experience([base], [1.0], world_tokenizer.pad_token_id, pivotal_credit=False)
    assert set(plain.turn_index[0][plain.loss_mask[0].bool()].tolist()) == {0, 1, 2, 3}


def test_invalid_reflection_means_no_retry_and_is_counted(world_suite, world_tokenizer):
    loop = AgentLoop(world_suite, ScriptedReflectionEngine(world_tokenizer, "I have no idea"), world_tokenizer)
    out = ReflectRetryExplorer().explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams()))
    assert [t.origin for t in out.groups[0]] == ["base", "base"]
    assert out.metrics["rollout/reflection_invalid_rate"] == 1.0
    assert all(t.info["reflection"] == "I have no idea" and t.info["reflection_error"] == "no_json" for t in out.groups[0])


def test_success_reflection_means_no_retry(world_suite, world_tokenizer):
    reflection = json.dumps({**VALID, "trajectory_outcome": "success"})
    loop = AgentLoop(world_suite, ScriptedReflectionEngine(world_tokenizer, reflection), world_tokenizer)
    out = ReflectRetryExplorer().explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams()))
    assert all(t.origin == "base" for t in out.groups[0])


def test_improving_retry_yields_meta_tasks(world_suite, world_tokenizer):
    task = world_suite.train_task(0)
    plan = world_suite.demonstration(task)

    class ExpertOnRetry(ScriptedReflectionEngine):
        def reply(self, text):
            if "Review this attempt" in text:
                return json.dumps({**VALID, "retry_from_step": 0, "improvement_suggestion": "do it right"})
            if "do it right" in text or "You are carrying" in text or "You take" in text:
                return expert_action(plan, text)
            return "<action>look</action>"

    loop = AgentLoop(world_suite, ExpertOnRetry(world_tokenizer, ""), world_tokenizer)
    out = ReflectRetryExplorer().explore([task], loop, ExplorationSpec(2, SamplingParams()))
    base, distilled = out.groups[0].trajectories
    assert not base.success and distilled.success
    assert out.metrics["rollout/retry_improvement_rate"] == 1.0
    origins = sorted(t.origin for t in out.sft)
    assert origins == ["reflect_sft", "retry_sft"]
    assert out.metrics["rollout/meta_task_samples"] == 2.0
    retry_sample = next(t for t in out.sft if t.origin == "retry_sft")
    assert "do it right" in world_tokenizer.decode(retry_sample.token_ids())  # trained under the guidance
    batch = collate_experience(out.sft, [0.0, 0.0], world_tokenizer.pad_token_id)
    assert batch.sft_mask.sum() > 0 and batch.loss_mask.sum() == 0


class ExpertEngine(ScriptedReflectionEngine):
    """Plays the task's expert plan; reflections are the fixed JSON."""

    def __init__(self, tokenizer, reflection, plan):
        super().__init__(tokenizer, reflection)
        self.plan = plan

    def reply(self, text):
        return self.reflection if "Review this attempt" in text else expert_action(self.plan, text)


def test_suite_reflector_uses_the_diagnostician_and_teaches_its_reflections(world_suite, world_tokenizer):
    for index in range(3):
        task = world_suite.train_task(index)
        plan = world_suite.demonstration(task)

        class FirstStepThenLook(ScriptedReflectionEngine):
            """Plays the expert's first action, then "look"; under guidance it follows the expert."""

            def reply(self, text):
                assert "Review this attempt" not in text, "the policy must not be asked to reflect"
                if "Suggestion:" in text or f"<action>{plan[0]}</action>" not in text:
                    return expert_action(plan, text)
                return "<action>look</action>"

        loop = AgentLoop(world_suite, FirstStepThenLook(world_tokenizer, ""), world_tokenizer)
        out = ReflectRetryExplorer(reflector="suite").explore([task], loop, ExplorationSpec(2, SamplingParams()))
        base, distilled = out.groups[0].trajectories
        diagnosis = world_suite.diagnose(task, base.actions, [t.feedback for t in base.turns])
        assert json.loads(base.info["reflection"]) == diagnosis and base.info["reflection_error"] == ""
        assert base.pivot == distilled.pivot == diagnosis["retry_from_step"] == 1
        assert out.metrics["rollout/pivot_accuracy"] == 1.0 and out.metrics["rollout/pivot_offset"] == 0.0
        assert distilled.success and not base.success
        assert out.metrics["rollout/retry_improvement_rate"] == 1.0
        # The retry improved, so a reflect sample teaches the diagnostician's reflection on this episode.
        reflect = [s for s in out.sft if s.origin == "reflect_sft"]
        assert len(reflect) == 1
        assert world_tokenizer.decode(reflect[0].turns[0].response_ids, skip_special_tokens=True) == json.dumps(diagnosis)


def test_successes_judged_failures_retry_unless_gated_on_reward(world_suite, world_tokenizer):
    task = world_suite.train_task(0)
    wrong_verdict = json.dumps({**VALID, "trajectory_outcome": "failure", "retry_from_step": 0})
    loop = AgentLoop(world_suite, ExpertEngine(world_tokenizer, wrong_verdict, world_suite.demonstration(task)), world_tokenizer)
    trusting = ReflectRetryExplorer().explore([task], loop, ExplorationSpec(4, SamplingParams()))
    assert all(t.success for t in trusting.groups[0])
    assert sorted(t.origin for t in trusting.groups[0]) == ["base", "base", "distilled", "distilled"]
    assert trusting.metrics["rollout/reflection_outcome_agreement"] == 0.0
    gated = ReflectRetryExplorer(retry_below_max_reward_only=True).explore([task], loop, ExplorationSpec(4, SamplingParams()))
    assert [t.origin for t in gated.groups[0]] == ["base", "base"]
    assert gated.metrics["rollout/retry_rate"] == 0.0


def test_refill_keeps_group_size_with_fresh_samples_where_no_retry_was_made(world_suite, world_tokenizer):
    task = world_suite.train_task(0)
    wrong_verdict = json.dumps({**VALID, "trajectory_outcome": "failure", "retry_from_step": 0})
    loop = AgentLoop(world_suite, ExpertEngine(world_tokenizer, wrong_verdict, world_suite.demonstration(task)), world_tokenizer)
    # The gate skips both retries (the expert's episodes succeed); refilling samples two fresh ones.
    out = ReflectRetryExplorer(retry_below_max_reward_only=True, refill_groups=True).explore(
        [task], loop, ExplorationSpec(4, SamplingParams())
    )
    assert [t.origin for t in out.groups[0]] == ["base", "base", "base", "base"]
    assert all("reflection" in t.info for t in out.groups[0].trajectories[:2])
    assert not any("reflection" in t.info for t in out.groups[0].trajectories[2:])
    assert out.metrics["rollout/refill_rate"] == 0.5
    # With every retry made there is nothing to refill.
    full = ReflectRetryExplorer(refill_groups=True).explore([task], loop, ExplorationSpec(4, SamplingParams()))
    assert sorted(t.origin for t in full.groups[0]) == ["base", "base", "distilled", "distilled"]
    assert full.metrics["rollout/refill_rate"] == 0.0


def test_wo_reflect_ablation_is_plain_sampling(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    out = ReflectRetryExplorer(retry=False).explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams(max_new_tokens=6)))
    assert len(out.groups[0]) == 4 and out.sft == []


def test_distill_requires_a_guided_turn():
    from r3lightning.types import Trajectory, Turn

    import pytest

    with pytest.raises(ValueError, match="no guided turn"):
        distill(Trajectory("t", [Turn([1], [2])]), pivot=0)


def test_scripted_reflection_samples_reflect_on_whole_episodes(world_suite, world_tokenizer):
    """The warm-start's reflect samples look like the policy's own episodes: played to the end after
    the mistake (a failure uses every turn) or recovered by the expert (an inefficient success)."""
    import random

    from r3lightning.rollout.warmstart import scripted_reflection_samples

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, lambda _: "look"), world_tokenizer)
    tasks = [world_suite.train_task(i) for i in range(24)]
    samples = scripted_reflection_samples(loop, ReflectRetryExplorer().reflector, tasks, random.Random(0))
    reflections = [json.loads(world_tokenizer.decode(s.turns[0].response_ids[:-1])) for s in samples if s.origin == "reflect_sft"]
    outcomes = {r["trajectory_outcome"] for r in reflections}
    assert {"failure", "success_but_inefficient"} <= outcomes
    for r in reflections:
        steps = int(r["trajectory_summary"].split()[0])
        assert 0 <= r["retry_from_step"] < steps
        if r["trajectory_outcome"] == "failure":
            assert steps == world_suite.max_turns
    retries = [s for s in samples if s.origin == "retry_sft"]
    assert retries and all(s.success for s in retries)


def test_scripted_reflection_samples_teach_success_judgments_on_clean_episodes(world_suite, world_tokenizer):
    """success_share: that share of tasks is played by the expert plan as it is; its reflection says
    ``success`` (pivot 0) and has no retry. At 0 no reflection says ``success``, and the random stream
    (which tasks get which mistake) is the one of a run without the option."""
    import random

    from r3lightning.rollout.warmstart import scripted_reflection_samples

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, lambda _: "look"), world_tokenizer)
    tasks = [world_suite.train_task(i) for i in range(16)]
    reflector = ReflectRetryExplorer().reflector

    def outcomes(samples):
        return [json.loads(world_tokenizer.decode(s.turns[0].response_ids[:-1]))["trajectory_outcome"]
                for s in samples if s.origin == "reflect_sft"]

    clean = scripted_reflection_samples(loop, reflector, tasks, random.Random(0), success_share=1.0)
    assert outcomes(clean) == ["success"] * len(tasks)
    assert not [s for s in clean if s.origin == "retry_sft"]
    plain = scripted_reflection_samples(loop, reflector, tasks, random.Random(0))
    assert "success" not in outcomes(plain)
    assert [s.turns[0].context_ids for s in plain] == [
        s.turns[0].context_ids for s in scripted_reflection_samples(loop, reflector, tasks, random.Random(0), success_share=0.0)
    ]
    mixed = outcomes(scripted_reflection_samples(loop, reflector, tasks, random.Random(0), success_share=0.5))
    assert 0 < mixed.count("success") < len(tasks)


def test_correct_success_judgments_become_reflect_samples(world_suite, world_tokenizer):
    """A reflection that says ``success`` of a full success is trained (``rollout/success_judgment_samples``);
    one that says it of a failure, or any with the option off, is not."""
    solved, failed = world_suite.train_task(0), world_suite.train_task(1)
    judged_success = json.dumps({**VALID, "trajectory_outcome": "success", "retry_from_step": 0})
    reply = world_player(world_suite, [solved, failed], [judged_success], solved_on_base=[0])
    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, reply), world_tokenizer)
    out = ReflectRetryExplorer().explore([solved, failed], loop, ExplorationSpec(4, SamplingParams()))
    assert [t.success for t in out.groups[0]] == [True, True] and [t.success for t in out.groups[1]] == [False, False]
    assert out.metrics["rollout/success_judgment_samples"] == 2.0  # the two solved episodes, not the two failed ones
    assert out.metrics["rollout/meta_task_samples"] == 0.0  # "look" retries never improve: no reflect/retry pair
    # The solved episodes follow the expert plan, and their reflection's label is the diagnostician's.
    assert out.metrics["rollout/clean_success_share"] == 1.0 and out.metrics["rollout/success_label_accuracy"] == 1.0
    judged = [s for s in out.sft if s.origin == "reflect_sft"]
    assert len(judged) == 2 and all(s.task_id == solved.task_id and s.reward == 1.0 for s in judged)
    assert world_tokenizer.decode(judged[0].turns[0].response_ids, skip_special_tokens=True) == judged_success
    off = ReflectRetryExplorer(train_success_judgments=False).explore([solved, failed], loop, ExplorationSpec(4, SamplingParams()))
    assert off.metrics["rollout/success_judgment_samples"] == 0.0 and off.sft == []


def test_pivot_accuracy_against_the_diagnostician_on_failures(world_suite, world_tokenizer):
    """``rollout/pivot_accuracy``: valid reflections on failed episodes whose pivot is the diagnostician's;
    ``rollout/pivot_offset``: their pivot minus the diagnostician's, mean. Successes and invalid
    reflections are not counted."""
    tasks = looks, first_then_looks, solved, unreadable = [world_suite.train_task(i) for i in range(4)]
    plans = {t.prompt.split("\n")[0]: world_suite.demonstration(t) for t in tasks}

    def reply(text):
        if "Review this attempt" in text:
            if unreadable.prompt.split("\n")[0] in text:
                return "not json"  # an invalid reflection is not counted
            return json.dumps({**VALID, "retry_from_step": 1})
        goal = next(g for g in plans if g in text)
        plan = plans[goal]
        if goal == solved.prompt.split("\n")[0]:
            return expert_action(plan, text)
        if goal == first_then_looks.prompt.split("\n")[0] and f"<action>{plan[0]}</action>" not in text:
            return f"<action>{plan[0]}</action>"
        return "<action>look</action>"

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, reply), world_tokenizer)
    out = ReflectRetryExplorer().explore(tasks, loop, ExplorationSpec(4, SamplingParams()))
    assert out.metrics["rollout/reflection_invalid_rate"] == 0.25
    for task, pivot in ((looks, 0), (first_then_looks, 1)):
        base = [t for t in out.groups[tasks.index(task)] if t.origin == "base"]
        assert all(world_suite.diagnose(task, b.actions)["retry_from_step"] == pivot for b in base)
    # Failures: 2 "look" episodes (diagnosed 0, reflected 1) and 2 "first action, then look" (diagnosed
    # 1, reflected 1); the solved task's 2 episodes are successes, the unreadable task's 2 reflections invalid.
    assert out.metrics["rollout/pivot_accuracy"] == 0.5
    assert out.metrics["rollout/pivot_offset"] == 0.5


def test_pivot_accuracy_is_not_logged_without_a_diagnostician_or_a_judged_failure(world_suite, world_tokenizer):
    suite, loop = scripted_arithmetic(json.dumps({**VALID, "retry_from_step": 0}))
    out = ReflectRetryExplorer(step_split="off").explore([suite.train_task(0)], loop, ExplorationSpec(2, SamplingParams()))
    assert out.metrics["rollout/retry_rate"] == 1.0
    assert "rollout/pivot_accuracy" not in out.metrics and "rollout/pivot_offset" not in out.metrics
    assert "rollout/clean_success_share" not in out.metrics
    # Only successes: nothing to check.
    task = world_suite.train_task(0)
    loop = AgentLoop(world_suite, ExpertEngine(world_tokenizer, json.dumps(VALID), world_suite.demonstration(task)), world_tokenizer)
    out = ReflectRetryExplorer().explore([task], loop, ExplorationSpec(2, SamplingParams()))
    assert "rollout/pivot_accuracy" not in out.metrics


def test_scripted_reflection_samples_show_the_reflectors_transcript(world_suite, world_tokenizer):
    """The warm-start teaches reflections on the transcript the RL reflector will read: a warm-start whose
    explorer reflects on full transcripts (r3l_reference's) shows system prompt, observations and responses."""
    import random

    from r3lightning.rollout.warmstart import scripted_reflection_samples

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, lambda _: "look"), world_tokenizer)
    tasks = [world_suite.train_task(i) for i in range(4)]

    def prompts(style):
        reflector = ReflectRetryExplorer(reflection_transcript=style).reflector
        samples = scripted_reflection_samples(loop, reflector, tasks, random.Random(0))
        return [world_tokenizer.decode(s.turns[0].context_ids) for s in samples if s.origin == "reflect_sft"]

    full, compact = prompts("full"), prompts("compact")
    assert len(full) == len(compact) == len(tasks)
    assert all("System: " in p and "Response 0: <action>" in p for p in full)
    assert not any("Response 0:" in p for p in compact)


def test_oracle_reflector_points_at_the_hidden_object_and_its_guidance_is_enough(make_world_suite):
    """r3l_oracle at difficulty 2: a policy that tries to take an object hidden in a closed container
    gets the diagnostician's pivot (that first step), its cause (the closed container) and the action to
    take instead; a retry that follows the suggested action, then the expert, improves on its base."""
    import re

    from harness import suite_tokenizer

    suite = make_world_suite(difficulty=2, max_turns=6)
    tokenizer = suite_tokenizer(suite, num_tasks=16)
    task = next(t for t in (suite.train_task(i) for i in range(64)) if suite.demonstration(t)[0].startswith("open"))
    plan = suite.demonstration(task)
    take = next(a for a in plan if a.startswith("take"))

    def reply(text):
        suggested = re.findall(r"do '([^']+)' instead", text)
        if suggested and f"<action>{suggested[0]}</action>" not in text:
            return f"<action>{suggested[0]}</action>"  # the guidance's action first, then the expert's
        return expert_action(plan, text) if suggested else f"<action>{take}</action>"

    loop = AgentLoop(suite, ScriptedEngine(tokenizer, reply), tokenizer)
    out = ReflectRetryExplorer(reflector="suite").explore([task], loop, ExplorationSpec(2, SamplingParams()))
    base, distilled = out.groups[0].trajectories
    reflection = json.loads(base.info["reflection"])
    container = plan[0].split()[1]
    assert reflection["retry_from_step"] == 0 and reflection["trajectory_outcome"] == "failure"
    assert f"is in the closed {container}" in reflection["root_cause_analysis"]
    assert reflection["improvement_suggestion"].startswith(f"At step 0, do '{plan[0]}' instead of '{take}'")
    assert not base.success and distilled.success and distilled.actions == plan
    assert out.metrics["rollout/retry_improvement_rate"] == 1.0 and out.metrics["rollout/pivot_accuracy"] == 1.0


def test_pivot_agreement_and_the_clamped_diagnosis_on_hand_built_episodes(world_suite):
    """``pivot_agreement`` on trajectories built by hand: only valid reflections on failures without a
    reward error count; an episode whose every action was optimal but ran out of turns is diagnosed at
    its last turn (``diagnosis_of``), where the raw diagnostician says one past it."""
    from r3lightning.rollout.explorers.reflect_retry import pivot_agreement
    from r3lightning.rollout.explorers.reflection import Reflection, diagnosis_of
    from r3lightning.types import Trajectory, Turn

    task = world_suite.train_task(0)
    plan = world_suite.demonstration(task)

    def episode(actions, success=False, reward_error=False):
        turns = [Turn([1], [2], action=a, feedback="") for a in actions]
        return Trajectory(task.task_id, turns, float(success), success, reward_error=reward_error)

    def said(k):
        return Reflection("s", "r", "failure", "i", k), ""

    wrong_first = episode(["look"] + plan[:1] + ["look", "look"])  # diagnosed 0
    stopped_short = episode(plan[:1])  # every action optimal, one short of the goal
    assert world_suite.diagnose(task, stopped_short.actions)["retry_from_step"] == 1
    assert diagnosis_of(world_suite, task, stopped_short)["retry_from_step"] == 0
    cases = [
        (wrong_first, said(0)),  # right
        (wrong_first, said(2)),  # 2 too late
        (stopped_short, said(0)),  # right, at the clamped pivot
        (episode(plan, success=True), said(1)),  # a success: not counted
        (wrong_first, (None, "no_json")),  # invalid: not counted
        (episode(["look"] * 4, reward_error=True), said(3)),  # unsound reward: not counted
    ]
    figures = pivot_agreement(world_suite, [task] * len(cases), [t for t, _ in cases], [p for _, p in cases])
    assert figures == {"rollout/pivot_accuracy": 2 / 3, "rollout/pivot_offset": 2 / 3}


def test_alternative_guidance_names_another_action_that_the_retry_takes(world_suite, world_tokenizer):
    """alternative_share: a retry sample's guidance names another admissible action at the pivot in
    place of the expert's, and the retry takes exactly that action there, then the expert finishes
    (so the guidance, not the observation, predicts the guided turn). At 0 the samples and the random
    stream are those of a run without the option."""
    import collections
    import random
    import re

    from r3lightning.rollout.warmstart import scripted_reflection_samples

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, lambda _: "look"), world_tokenizer)
    tasks = [world_suite.train_task(i) for i in range(24)]
    reflector = ReflectRetryExplorer().reflector
    plain = scripted_reflection_samples(loop, reflector, tasks, random.Random(0))
    assert [s.token_ids() for s in plain] == [
        s.token_ids() for s in scripted_reflection_samples(loop, reflector, tasks, random.Random(0), alternative_share=0.0)
    ]

    def guided(samples):
        out = []
        for s in samples:
            if s.origin != "retry_sft":
                continue
            k = next(i for i, t in enumerate(s.turns) if t.trainable)
            context = world_tokenizer.decode(s.turns[k].context_ids)
            out.append((re.findall(r"Suggestion: [^']*'([^']+)'", context)[0], s.turns[k].action, s.success))
        return out

    expert = guided(plain)
    assert expert and all(suggested == taken for suggested, taken, _ in expert)
    counts = collections.Counter()
    alternative = guided(scripted_reflection_samples(loop, reflector, tasks, random.Random(0), alternative_share=1.0, counts=counts))
    assert alternative and all(suggested == taken and success for suggested, taken, success in alternative)
    renamed = sum(a[0] != e[0] for a, e in zip(alternative, expert))
    assert renamed >= len(alternative) // 2
    # Every draw is counted: an alternative (the guidance names another action) or a fallback to the expert's.
    assert counts["alternative_guidance"] == renamed
    assert counts["alternative_guidance"] + counts["alternative_unavailable"] == len(alternative)


def test_success_label_agreement_on_hand_built_episodes(world_suite):
    """``success_label_agreement`` on successes without a reward error: ``rollout/clean_success_share``
    is the share the diagnostician calls ``success`` (every action on a shortest path), the only
    episodes a correct judgment may call ``success``; ``rollout/success_label_accuracy`` is the share
    of valid reflections on them whose label is the diagnostician's. Failures and invalid reflections
    are not counted; no success, or no diagnostician, logs nothing."""
    from r3lightning.rollout.explorers.reflect_retry import success_label_agreement
    from r3lightning.rollout.explorers.reflection import Reflection
    from r3lightning.types import Trajectory, Turn

    task = world_suite.train_task(0)
    plan = world_suite.demonstration(task)

    def episode(actions, success=True, reward_error=False):
        turns = [Turn([1], [2], action=a, feedback="") for a in actions]
        return Trajectory(task.task_id, turns, float(success), success, reward_error=reward_error)

    def said(outcome):
        return Reflection("s", "r", outcome, "i", 0), ""

    clean, detour = episode(plan), episode(["look"] + plan)
    assert world_suite.diagnose(task, detour.actions)["trajectory_outcome"] == "success_but_inefficient"
    cases = [
        (clean, said("success")),  # clean, right
        (clean, said("success_but_inefficient")),  # clean, wrong
        (detour, said("success_but_inefficient")),  # inefficient, right
        (detour, (None, "no_json")),  # inefficient, invalid: counts for the share only
        (episode(["look"] * 4, success=False), said("success")),  # a failure: not counted
        (episode(plan, reward_error=True), said("success")),  # unsound reward: not counted
    ]
    figures = success_label_agreement(world_suite, [task] * len(cases), [t for t, _ in cases], [p for _, p in cases])
    assert figures == {"rollout/clean_success_share": 2 / 4, "rollout/success_label_accuracy": 2 / 3}
    assert success_label_agreement(world_suite, [task], [episode(["look"], success=False)], [said("failure")]) == {}


# ---- free-text reflections (reflection_format: text) ------------------------------------------------
def _played(turns: int, success: bool):
    from r3lightning.types import Trajectory, Turn

    return Trajectory("t", turns=[Turn(context_ids=[], response_ids=[1]) for _ in range(turns)], reward=float(success), success=success)


def test_text_reflection_takes_the_first_step_it_names_within_range():
    from r3lightning.rollout.explorers.reflection import parse_text_reflection

    reflection, reason = parse_text_reflection("  Step 7 is odd; step 2 went wrong, redo step 1.  ", _played(3, False))
    # "Step 7" is beyond the 3 steps (0-2): the first named step in range is 2.
    assert reason == "" and reflection.retry_from_step == 2
    assert reflection.improvement_suggestion == reflection.root_cause_analysis == "Step 7 is odd; step 2 went wrong, redo step 1."
    assert reflection.trajectory_outcome == "failure" and not reflection.judged
    assert parse_text_reflection("Add the ones first.", _played(3, False))[0].retry_from_step == 0
    assert parse_text_reflection("fine", _played(1, True))[0].trajectory_outcome == "success"
    assert parse_text_reflection(" \n ", _played(2, False)) == (None, "empty")


def test_text_reflections_drive_retries_and_train_no_success_judgment(world_suite, world_tokenizer):
    class TextReflections(ScriptedReflectionEngine):
        def reply(self, text):
            if "say what went wrong" in text:
                return "Retry from step 1 and TEXT-MARKER."
            return "<action>look</action>"

    engine = TextReflections(world_tokenizer, "")
    loop = AgentLoop(world_suite, engine, world_tokenizer)
    out = ReflectRetryExplorer(reflection_format="text").explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams()))
    base = [t for t in out.groups[0] if t.origin == "base"]
    distilled = [t for t in out.groups[0] if t.origin == "distilled"]
    assert len(distilled) == 2 and all(d.pivot == b.pivot == 1 for b, d in zip(base, distilled))
    assert all(t.info["reflection"] == "Retry from step 1 and TEXT-MARKER." and t.info["reflection_error"] == "" for t in base)
    assert any("Advice from a review of an earlier attempt: Retry from step 1 and TEXT-MARKER." in p for p in engine.prompts)
    assert out.metrics["rollout/reflection_invalid_rate"] == 0.0 and out.metrics["rollout/retry_rate"] == 1.0
    assert out.metrics["rollout/reflection_outcome_agreement"] == 0.0  # nothing judged
    assert out.metrics["rollout/success_judgment_samples"] == 0.0
