"""Task streams, demonstrations from files and collation."""

import json

import pytest
import torch
from harness import TINY_SPEC

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.collate import collate_experience
from r3lightning.data.datamodule import TaskStream
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


def test_validation_answers_get_the_training_token_budget_unless_set():
    from r3lightning.data.datamodule import RolloutDataModule
    from r3lightning.envs.math_env import MathSuite
    from r3lightning.engines.base import SamplingParams

    suite = MathSuite(source="arithmetic", num_val_tasks=2)
    data = RolloutDataModule(suite, sampling=SamplingParams(temperature=0.7, max_new_tokens=300, stop=["\n\n"]))
    assert (data.val_sampling.max_new_tokens, data.val_sampling.temperature, data.val_sampling.stop) == (300, 1.0, ["\n\n"])
    own = RolloutDataModule(suite, sampling=SamplingParams(max_new_tokens=300), val_sampling=SamplingParams(max_new_tokens=20))
    assert own.val_sampling.max_new_tokens == 20


