"""The warm-start's producer (``data/demonstrations.py``): demonstration files, the suite's scripted
demonstrations and reflections, and their schedule within the warm-start."""

import json

import pytest
from harness import TINY_SPEC

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.demonstrations import DemoConfig, conversation_trajectory, load_chat_jsonl


def test_chat_jsonl_errors_name_file_row_and_field(tmp_path):
    path = tmp_path / "demos.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"demos.jsonl, row 2: field 'messages'"):
        load_chat_jsonl(str(path))
    path.write_text(json.dumps(good) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"row 2: not valid JSON"):
        load_chat_jsonl(str(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant message"):
        load_chat_jsonl(str(path))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_chat_jsonl(str(tmp_path / "missing.jsonl"))
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_chat_jsonl(str(path))


def test_conversation_trajectory_matches_chat_template(world_tokenizer):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<action>look</action>"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "<action>take apple</action>"},
    ]
    traj = conversation_trajectory(messages, world_tokenizer, "demo-0")
    assert len(traj.turns) == 2 and traj.origin == "demo"
    rendered = world_tokenizer.apply_chat_template(messages, tokenize=False)
    assert world_tokenizer.decode(traj.token_ids()) == rendered.rstrip("\n")


def test_reflection_demos_limited_to_reflection_tasks_per_step():
    from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    suite = ProceduralWorldSuite(difficulty=1, max_turns=4, num_val_tasks=2, goal_reminder=True)
    dm = RolloutDataModule(suite, explorer=ReflectRetryExplorer(), tasks_per_step=2)
    tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
    engine = HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer)
    dm.connect(engine, tokenizer, AlgorithmConfig(), DemoConfig(reflections=True, tasks_per_step=4, reflection_tasks_per_step=1))
    demos = dm.demonstrations(TaskBatch(step=0, tasks=[suite.train_task(0), suite.train_task(1)])).exploration.sft
    origins = [d.origin for d in demos]
    assert origins.count("demo") == 4 and origins.count("reflect_sft") == 1 and origins.count("retry_sft") <= 1
    assert all(d.success for d in demos if d.origin == "demo")


def test_warmstart_step_logs_its_alternative_guidance_draws_only_when_the_option_is_on():
    """``demos.alternative_guidance_share``: each warm-start step logs how many retry samples got an
    alternative's guidance and how many draws fell back to the expert's (every draw is one or the other)."""
    from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    def warmstart_metrics(share: float) -> dict:
        suite = ProceduralWorldSuite(difficulty=2, max_turns=6, num_val_tasks=2, goal_reminder=True)
        demos = DemoConfig(reflections=True, tasks_per_step=2, reflection_tasks_per_step=8, alternative_guidance_share=share)
        dm = RolloutDataModule(suite, explorer=ReflectRetryExplorer(), tasks_per_step=2)
        tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
        dm.connect(HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer), tokenizer, AlgorithmConfig(), demos)
        step = dm.demonstrations(TaskBatch(step=0, tasks=[suite.train_task(i) for i in range(8)]))
        retries = sum(t.origin == "retry_sft" for t in step.exploration.sft)
        return step.exploration.metrics, retries

    off, _ = warmstart_metrics(0.0)
    assert "warmstart/alternative_guidance_samples" not in off
    on, retries = warmstart_metrics(1.0)
    assert on["warmstart/alternative_guidance_samples"] > 0
    assert on["warmstart/alternative_guidance_samples"] + on["warmstart/alternative_guidance_unavailable"] == retries


def test_success_reflections_start_at_their_step_and_the_steps_before_are_those_of_share_zero():
    """``demos.success_reflection_from_step``: before that warm-start step no clean episode is played and
    the step's samples are a share-0 run's (same random stream); from it on the share applies."""
    from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    def reflect_contexts(step: int, share: float, from_step: int) -> tuple[list[list[int]], int]:
        suite = ProceduralWorldSuite(difficulty=1, max_turns=4, num_val_tasks=2, goal_reminder=True)
        demos = DemoConfig(reflections=True, tasks_per_step=4, reflection_tasks_per_step=4,
                           success_reflection_share=share, success_reflection_from_step=from_step)
        dm = RolloutDataModule(suite, explorer=ReflectRetryExplorer(), tasks_per_step=4)
        tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
        dm.connect(HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer), tokenizer, AlgorithmConfig(), demos)
        samples = dm.demonstrations(TaskBatch(step=step, tasks=[suite.train_task(4 * step + i) for i in range(4)])).exploration.sft
        reflections = [s for s in samples if s.origin == "reflect_sft"]
        retries = [s for s in samples if s.origin == "retry_sft"]
        return [s.turns[0].context_ids for s in reflections], len(retries)

    before, retries_before = reflect_contexts(step=2, share=1.0, from_step=3)
    assert (before, retries_before) == reflect_contexts(step=2, share=0.0, from_step=0)
    assert retries_before > 0
    after, retries_after = reflect_contexts(step=3, share=1.0, from_step=3)
    assert (after, retries_after) == reflect_contexts(step=3, share=1.0, from_step=0)
    assert retries_after == 0  # every reflection task played clean: a success judgment, no retry


def test_success_reflection_from_step_must_not_be_negative():
    with pytest.raises(ValueError, match="success_reflection_from_step"):
        DemoConfig(reflections=True, success_reflection_from_step=-1)


def test_a_suite_demonstration_that_never_ends_its_episode_is_one_clear_error(world_suite, world_tokenizer):
    """A demonstration whose actions run out before the environment says done (here: only the first of
    the expert's actions) stops the warm-start naming the suite's method, the task and what to change,
    not the agent loop's internal "scripted responses ran out"."""
    from harness import tiny_loop

    from r3lightning.data.demonstrations import Demonstrations
    from r3lightning.rollout.explorers.reflection import Reflector

    class ShortDemoSuite(type(world_suite)):
        def demonstration(self, task):
            return super().demonstration(task)[:1]

    suite = ShortDemoSuite(difficulty=1, num_val_tasks=8, max_turns=4)
    task = suite.train_task(0)
    assert len(world_suite.demonstration(task)) > 1  # one action does not finish this task
    demos = Demonstrations(DemoConfig(), suite, tiny_loop(suite, world_tokenizer), Reflector.with_builtin_templates(), world_tokenizer, 1)
    with pytest.raises(ValueError) as caught:
        demos.samples(0, [task], 0, 1, 0)
    assert str(caught.value) == (
        f"data.suite ShortDemoSuite.demonstration (task {task.task_id!r}) ended before the episode did (1 action given, "
        "1 turn played, up to 4 allowed, and the environment had not said done); the warm-start "
        "(model.phases.warmstart.demos.source=suite) trains whole episodes: make ShortDemoSuite.demonstration return "
        "every action up to the episode's end, or give model.phases.warmstart.demos.source a JSONL file of demonstrations"
    )
