"""The module's frozen-teacher KL term (ReflectRL's reflective-to-direct distillation)."""

import copy

import pytest
import torch

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.experience import make_experience
from r3lightning.data.step_rollout import StepRollout
from r3lightning.training.models import build_tiny_model
from r3lightning.module import R3LightningModule
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import Group, Trajectory, Turn
from conftest import TINY_SPEC


def batch(tokenizer):
    ids = tokenizer("Compute 2+3. \\boxed{5}", add_special_tokens=False)["input_ids"]
    turns = [Turn(ids[:4], ids[4:], [-1.0] * len(ids[4:]))]
    groups = [Group("t", [Trajectory("t", turns, reward=1.0, success=True), Trajectory("t", turns, reward=0.0)])]
    experience, _ = make_experience(StepRollout(Exploration(groups)), AlgorithmConfig(policy_loss="pg"), tokenizer.pad_token_id)
    return experience


def module_with(policy, tokenizer):
    module = R3LightningModule(algorithm=AlgorithmConfig(policy_loss="pg"))
    module.policy, module.tokenizer = policy, tokenizer
    return module


@pytest.mark.parametrize("estimator", ["exact", "sampled"])
def test_teacher_kl_is_zero_for_the_same_policy_and_positive_otherwise(world_tokenizer, estimator):
    policy = build_tiny_model(TINY_SPEC, world_tokenizer, seed=0)
    module = module_with(policy, world_tokenizer)
    experience = batch(world_tokenizer)
    totals = {"rl_tokens": float(experience.loss_mask[:, 1:].sum()), "rl_seqs": 2.0, "sft_tokens": 0.0, "sft_seqs": 0.0}
    module.set_teacher(copy.deepcopy(policy), coef=0.5, estimator=estimator)
    same = module.micro_batch_loss(experience, totals)
    assert float(same["loss_teacher_kl"]) == pytest.approx(0.0, abs=1e-6)
    module.set_teacher(build_tiny_model(TINY_SPEC, world_tokenizer, seed=1), coef=0.5, estimator=estimator)
    other = module.micro_batch_loss(experience, totals)
    assert float(other["loss_teacher_kl"]) > 1e-4
    other["loss_teacher_kl"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.grad is None for p in module.teacher.parameters())  # the teacher stays frozen


def test_teacher_is_not_part_of_the_module_state(world_tokenizer):
    policy = build_tiny_model(TINY_SPEC, world_tokenizer, seed=0)
    module = module_with(policy, world_tokenizer)
    before = set(module.state_dict())
    module.set_teacher(copy.deepcopy(policy), coef=0.1)
    assert set(module.state_dict()) == before
    with pytest.raises(ValueError, match="exact' or 'sampled"):
        module.set_teacher(policy, coef=0.1, estimator="k9")


def test_a_context_teacher_scores_the_same_response_under_its_own_prompt(world_tokenizer):
    """Context distillation by hand: the teacher's logits on the response tokens after its prompt, the
    student's after the student's; the same weights with another context give a KL that is not zero."""
    from r3lightning import algos

    policy = build_tiny_model(TINY_SPEC, world_tokenizer, seed=0)
    module = module_with(policy, world_tokenizer)
    experience = batch(world_tokenizer)
    ids = world_tokenizer("Compute 2+3. \\boxed{5}", add_special_tokens=False)["input_ids"]
    prompt, response = ids[:4], ids[4:]
    teacher_prompt = world_tokenizer("Compute 2+3. A previous answer, which is wrong: 6", add_special_tokens=False)["input_ids"]
    assert len(teacher_prompt) != len(prompt)
    totals = {"rl_tokens": float(experience.loss_mask[:, 1:].sum()), "rl_seqs": 2.0, "sft_tokens": 0.0, "sft_seqs": 0.0}
    teacher = copy.deepcopy(policy)
    module.set_teacher(teacher, coef=0.5, contexts={tuple(prompt): teacher_prompt})
    out = module.micro_batch_loss(experience, totals)
    with torch.no_grad():
        student_logits = policy(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        teacher_logits = teacher(input_ids=torch.tensor([teacher_prompt + response])).logits[0, len(teacher_prompt) - 1 : -1]
        by_hand = algos.full_kl(student_logits, teacher_logits).mean()
    assert by_hand > 1e-4  # the same weights, another context: the KL is not zero
    torch.testing.assert_close(out["loss_teacher_kl"].detach(), 0.5 * by_hand, rtol=1e-4, atol=1e-6)
    assert float(out["teacher_context_rows"]) == 2.0 and float(out["teacher_rows"]) == 2.0
    # A prompt without a context is scored under its own: the same weights give zero.
    module.set_teacher(teacher, coef=0.5, contexts={(1, 2, 3): teacher_prompt})
    out = module.micro_batch_loss(experience, totals)
    assert float(out["loss_teacher_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(out["teacher_context_rows"]) == 0.0
