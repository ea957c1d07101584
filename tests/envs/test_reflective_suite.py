"""ReflectiveSuite: reflective training tasks (a GNT in context) below ``direct_from_index``, the wrapped
suite's own tasks from it on, and validation that shows a GNT only while ``show_gnt_in_validation``."""

import json

import pytest
from reflectrl_helpers import arithmetic_suite, write_pool

from r3lightning.envs.math_env import extract_answer
from r3lightning.envs.reflective import ReflectiveSuite, reflective_prompt


@pytest.fixture()
def pool_path(tmp_path):
    path = tmp_path / "pool.jsonl"
    write_pool(path, arithmetic_suite(), num_train=6)
    return str(path)


def test_training_tasks_switch_to_direct_at_the_index(pool_path):
    inner = arithmetic_suite()
    suite = ReflectiveSuite(arithmetic_suite(), pool_path, direct_from_index=10, direct_tasks="suite")
    reflective = [suite.train_task(i) for i in range(10)]
    assert all(t.data["reflective"] and "A previous answer, which is wrong:" in t.prompt for t in reflective)
    # Only the wrong answers are shown, each with its own question and reference answer.
    for t in reflective:
        assert t.data["direct_prompt"] in t.prompt and extract_answer(t.data["gnt"]) != t.answer
    assert [suite.train_task(i) for i in range(10, 14)] == [inner.train_task(i) for i in range(10, 14)]
    # A pure function of the index, in a second instance too.
    again = ReflectiveSuite(arithmetic_suite(), pool_path, direct_from_index=10, direct_tasks="suite")
    assert [again.train_task(i) for i in range(14)] == [suite.train_task(i) for i in range(14)]
    # Each pass over the 6 GNTs shows every one once.
    assert len({t.task_id for t in reflective[:6]}) == 6
    assert ReflectiveSuite(arithmetic_suite(), pool_path).is_direct(10**9) is False


def test_reflective_task_verifies_like_the_question(pool_path):
    suite = ReflectiveSuite(arithmetic_suite(), pool_path)
    task = suite.train_task(0)
    env = suite.make_env()
    assert env.reset(task) == task.prompt
    assert env.step(suite.demonstration(task)[0]).reward == 1.0  # the scripted critique ends in the right answer
    env.reset(task)
    assert env.step(task.data["gnt"]).reward == 0.0


def test_validation_shows_the_gnt_only_when_asked(pool_path):
    suite = ReflectiveSuite(arithmetic_suite(), pool_path)
    inner_val = arithmetic_suite().val_tasks()
    val = suite.val_tasks()
    assert [t.task_id for t in val] == [t.task_id for t in inner_val]
    assert suite.val_gnt_coverage == 1.0
    task = val[0]
    shown = suite.make_env().reset(task)
    assert shown == reflective_prompt(inner_val[0].prompt, task.data["gnt"], suite.template)
    suite.show_gnt_in_validation = False
    assert suite.make_env().reset(task) == inner_val[0].prompt


def test_suite_settings_are_checked(pool_path, tmp_path):
    with pytest.raises(ValueError, match="single-turn"):
        ReflectiveSuite(arithmetic_suite(max_attempts=2), pool_path)
    with pytest.raises(ValueError, match="attempt"):
        ReflectiveSuite(arithmetic_suite(), pool_path, template="{question} only")
    with pytest.raises(FileNotFoundError, match="gnt-pool"):
        ReflectiveSuite(arithmetic_suite(), str(tmp_path / "none.jsonl")).train_task(0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"label": "gnt"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, row 1: not a GNT pool row"):
        ReflectiveSuite(arithmetic_suite(), str(bad)).train_task(0)


def test_teacher_prompts_hold_training_gnts_only(pool_path):
    """Context distillation's teacher prompts: each training question with a GNT -> its reflective prompt;
    the validation questions' GNTs (shown in reflective validation) never become a teacher's context."""
    suite = ReflectiveSuite(arithmetic_suite(), pool_path)
    rows = [json.loads(line) for line in open(pool_path)]
    train_gnt = [r for r in rows if r["label"] == "gnt" and r["split"] == "train"]
    prompts = suite.teacher_prompts()
    assert set(prompts) == {r["prompt"] for r in train_gnt}
    first = train_gnt[0]
    assert prompts[first["prompt"]] == reflective_prompt(first["prompt"], first["response"])
    assert not set(prompts) & {t.prompt for t in suite.val_tasks()}


def test_direct_tasks_from_the_pool_are_its_training_questions(pool_path):
    """The default: stage 2 asks the questions the expert answered (each once per pass), as direct tasks."""
    suite = ReflectiveSuite(arithmetic_suite(), pool_path, direct_from_index=0)
    rows = [json.loads(line) for line in open(pool_path)]
    train = {r["prompt"]: r for r in rows if r["split"] == "train"}
    tasks = [suite.train_task(i) for i in range(2 * len(train))]
    assert not any(t.data.get("reflective") for t in tasks)
    assert sorted(t.prompt for t in tasks[: len(train)]) == sorted(train)  # one pass: each question once
    assert all(t.answer == train[t.prompt]["answer"] and t.task_id == train[t.prompt]["task_id"] for t in tasks)
    assert [suite.train_task(i) for i in range(len(tasks))] == tasks  # a pure function of the index
    with pytest.raises(ValueError, match="direct_tasks"):
        ReflectiveSuite(arithmetic_suite(), pool_path, direct_tasks="both")
