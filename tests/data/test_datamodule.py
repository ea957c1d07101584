"""Task streams, demonstrations from files and collation."""

import json

import pytest
import torch
from harness import TINY_SPEC

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.collate import collate_experience
from r3lightning.data.datamodule import TaskStream, conversation_trajectory, load_chat_jsonl
from r3lightning.types import Trajectory, Turn


def _ids(stream, n):
    it = iter(stream)
    return [[t.task_id for t in next(it).tasks] for _ in range(n)]


def test_task_stream_shards_by_rank_and_resumes_at_cursor():
    from digit_suite import DigitSuite

    suite = DigitSuite()  # task ids name the stream position (a math problem drawn twice is one task)
    rank0 = _ids(TaskStream(suite, 3, 0, rank=0, world_size=2), 4)
    rank1 = _ids(TaskStream(suite, 3, 0, rank=1, world_size=2), 4)
    flat0, flat1 = sum(rank0, []), sum(rank1, [])
    assert not set(flat0) & set(flat1)
    resumed = _ids(TaskStream(suite, 3, 2, rank=0, world_size=2), 2)
    assert resumed == rank0[2:]
    steps = [b.step for b, _ in zip(TaskStream(suite, 3, 5, 0, 1), range(3))]
    assert steps == [5, 6, 7]


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


def test_collate_masks_hand_made():
    rl = Trajectory("a", [Turn([1, 2], [3, 4], [-0.1, -0.2]), Turn([5], [6], [-0.3])], reward=1.0, pivot=1)
    sft = Trajectory("b", [Turn([1], [7, 8])], origin="retry_sft")
    bad = Trajectory("c", [Turn([1], [9], [-0.5])], reward=1.0, reward_error=True)
    batch = collate_experience([rl, sft, bad], [2.0, 0.0, 5.0], pad_token_id=0, pivotal_credit=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 7, 8, 0, 0, 0], [1, 9, 0, 0, 0, 0]]
    assert batch.turn_index.tolist()[0] == [-1, -1, 0, 0, -1, 1]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 0, 1], [0] * 6, [0] * 6]
    assert batch.sft_mask.tolist()[1] == [0, 1, 1, 0, 0, 0]
    assert batch.advantages.tolist()[0] == [0, 0, 0, 0, 0, 2.0]
    assert batch.old_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, -0.3])
    no_pivot = collate_experience([rl], [1.0], 0, pivotal_credit=False)
    assert no_pivot.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1]]


def test_collate_untrainable_turns_and_max_length():
    traj = Trajectory("a", [Turn([1], [2, 3], trainable=False), Turn([4], [5, 6])], origin="retry_sft")
    batch = collate_experience([traj], [0.0], 0, max_length=5)
    assert batch.input_ids.shape == (1, 5)
    assert batch.sft_mask.tolist() == [[0, 0, 0, 0, 1]]


def test_micro_batch_slice_trims_padding():
    rows = [Trajectory("a", [Turn([1], [2, 3, 4, 5], [0.0] * 4)]), Trajectory("b", [Turn([1], [2], [0.0])])]
    batch = collate_experience(rows, [1.0, 1.0], 0)
    assert batch.slice(1, 2).input_ids.shape == (1, 2)
    assert torch.equal(batch.slice(0, 2).input_ids, batch.input_ids)


def test_micro_batches_group_rows_by_length_and_take_keeps_rows_whole():
    rows = [
        Trajectory("short", [Turn([1], [2], [-0.1])], reward=0.0),
        Trajectory("long", [Turn([1], [2, 3, 4, 5], [-0.2] * 4)], reward=1.0, origin="distilled"),
        Trajectory("mid", [Turn([1], [6, 7], [-0.3] * 2)], reward=0.5),
    ]
    batch = collate_experience(rows, [0.0, 2.0, 1.0], 0)
    assert [m.tolist() for m in batch.micro_batches(2)] == [[1, 2], [0]]
    first = batch.take(torch.tensor([1, 2]))
    assert first.task_ids == ["long", "mid"] and first.origins == ["distilled", "base"]
    assert first.rewards.tolist() == [1.0, 0.5]
    for new_row, old_row in enumerate([1, 2]):
        for name in ("input_ids", "attention_mask", "loss_mask", "advantages", "old_logprobs"):
            assert torch.equal(getattr(first, name)[new_row], getattr(batch, name)[old_row]), name
    # The short row's micro-batch is padded to its own length (2 tokens), not the batch's (5).
    assert batch.take(torch.tensor([0])).input_ids.shape == (1, 2)
    with pytest.raises(ValueError, match="micro-batch size"):
        batch.micro_batches(0)


def test_reflection_demos_limited_to_reflection_tasks_per_step():
    from r3lightning.data.datamodule import DemoConfig, RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    suite = ProceduralWorldSuite(difficulty=1, max_turns=4, num_val_tasks=2, goal_reminder=True)
    dm = RolloutDataModule(
        suite,
        explorer=ReflectRetryExplorer(),
        tasks_per_step=2,
        demos=DemoConfig(reflections=True, tasks_per_step=4, reflection_tasks_per_step=1),
    )
    tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
    engine = HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer)
    dm.connect(engine, tokenizer, AlgorithmConfig())
    demos = dm.demonstrations(TaskBatch(step=0, tasks=[suite.train_task(0), suite.train_task(1)]))
    origins = [d.origin for d in demos]
    assert origins.count("demo") == 4 and origins.count("reflect_sft") == 1 and origins.count("retry_sft") <= 1
    assert all(d.success for d in demos if d.origin == "demo")


def test_validation_answers_get_the_training_token_budget_unless_set():
    from r3lightning.data.datamodule import RolloutDataModule
    from r3lightning.envs.math_env import MathSuite
    from r3lightning.engines.base import SamplingParams

    suite = MathSuite(source="arithmetic", num_val_tasks=2)
    data = RolloutDataModule(suite, sampling=SamplingParams(temperature=0.7, max_new_tokens=300, stop=["\n\n"]))
    assert (data.val_sampling.max_new_tokens, data.val_sampling.temperature, data.val_sampling.stop) == (300, 1.0, ["\n\n"])
    own = RolloutDataModule(suite, sampling=SamplingParams(max_new_tokens=300), val_sampling=SamplingParams(max_new_tokens=20))
    assert own.val_sampling.max_new_tokens == 20


def test_warmstart_step_logs_its_alternative_guidance_draws_only_when_the_option_is_on():
    """``demos.alternative_guidance_share``: each warm-start step logs how many retry samples got an
    alternative's guidance and how many draws fell back to the expert's (every draw is one or the other)."""
    from r3lightning.data.datamodule import DemoConfig, RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    def warmstart_metrics(share: float) -> dict:
        suite = ProceduralWorldSuite(difficulty=2, max_turns=6, num_val_tasks=2, goal_reminder=True)
        demos = DemoConfig(reflections=True, tasks_per_step=2, reflection_tasks_per_step=8, alternative_guidance_share=share)
        dm = RolloutDataModule(suite, explorer=ReflectRetryExplorer(), tasks_per_step=2, demos=demos)
        tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
        dm.connect(HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer), tokenizer, AlgorithmConfig())
        step = dm.rollout(TaskBatch(step=0, tasks=[suite.train_task(i) for i in range(8)]), "sft")
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
    from r3lightning.data.datamodule import DemoConfig, RolloutDataModule, TaskBatch
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
    from r3lightning.training.models import build_tiny_model, build_tokenizer
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    def reflect_contexts(step: int, share: float, from_step: int) -> tuple[list[list[int]], int]:
        suite = ProceduralWorldSuite(difficulty=1, max_turns=4, num_val_tasks=2, goal_reminder=True)
        demos = DemoConfig(reflections=True, tasks_per_step=4, reflection_tasks_per_step=4,
                           success_reflection_share=share, success_reflection_from_step=from_step)
        dm = RolloutDataModule(suite, explorer=ReflectRetryExplorer(), tasks_per_step=4, demos=demos)
        tokenizer = build_tokenizer(dm.tokenizer_corpus(), vocab_size=TINY_SPEC.vocab_size)
        dm.connect(HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer), tokenizer, AlgorithmConfig())
        samples = dm.demonstrations(TaskBatch(step=step, tasks=[suite.train_task(4 * step + i) for i in range(4)]))
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
    from r3lightning.data.datamodule import DemoConfig

    with pytest.raises(ValueError, match="success_reflection_from_step"):
        DemoConfig(reflections=True, success_reflection_from_step=-1)
