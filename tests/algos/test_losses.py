import math

import pytest
import torch

from r3lightning.algos import (
    aggregate,
    entropy_from_logits,
    full_kl,
    kl_estimate,
    masked_mean,
    pivotal_mask,
    policy_loss,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    sft_nll,
    shaped_off_policy_loss,
)


def test_selective_log_softmax_matches_log_softmax():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[2, 1]])
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert selective_log_softmax(logits, ids).tolist()[0] == pytest.approx([3 - z, -math.log(3)])


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 64])
def test_log_probs_and_entropy_in_row_chunks_equal_row_by_row_to_the_bit(rows_per_chunk):
    """Rows are taken several at a time, up to a budget of logits (peak memory bounded as before); each
    row's values and gradients are bit-identical to computing it alone, so no seeded run changes."""
    torch.manual_seed(0)
    logits = torch.randn(10, 7, 50)
    ids = torch.randint(0, 50, (10, 7))
    budget = rows_per_chunk * 7 * 50
    alone = logits.clone().requires_grad_()
    chunked = logits.clone().requires_grad_()
    rows = torch.stack([selective_log_softmax(row[None], row_ids[None], max_logits=7 * 50)[0] for row, row_ids in zip(alone, ids)])
    together = selective_log_softmax(chunked, ids, max_logits=budget)
    assert torch.equal(rows, together)
    (rows * torch.arange(7)).sum().backward()
    (together * torch.arange(7)).sum().backward()
    assert torch.equal(alone.grad, chunked.grad)
    assert torch.equal(torch.cat([entropy_from_logits(row[None], max_logits=7 * 50) for row in logits]),
                       entropy_from_logits(logits, max_logits=budget))


def test_selective_log_softmax_gradient_is_onehot_minus_softmax():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]], requires_grad=True)
    selective_log_softmax(logits, torch.tensor([[2]])).sum().mul(2.0).backward()
    z = math.exp(1) + math.exp(2) + math.exp(3)
    expected = [-2 * math.exp(1) / z, -2 * math.exp(2) / z, 2 - 2 * math.exp(3) / z]
    assert logits.grad[0, 0].tolist() == pytest.approx(expected, rel=1e-6)


def _autograd_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The formula left to autograd: what ``selective_log_softmax`` computed before its own backward."""
    x = logits.float()
    return x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions_per_chunk", [1, 3, 70])
def test_chunked_log_probs_equal_autograd_formula_to_the_bit(dtype, positions_per_chunk):
    """Its hand-written backward runs the float operations autograd runs for gather - logsumexp, chunk by
    chunk: log-probs, gradients (in the logits' dtype) and entropies are the same bits."""
    torch.manual_seed(0)
    logits = (torch.randn(10, 7, 50) * 3).to(dtype)
    ids = torch.randint(0, 50, (10, 7))
    weights = torch.randn(10, 7)
    reference, chunked = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected = _autograd_log_probs(reference, ids)
    logp, entropy = selective_log_softmax_and_entropy(chunked, ids, max_logits=positions_per_chunk * 50)
    assert torch.equal(logp, expected)
    assert torch.equal(entropy, entropy_from_logits(logits))
    assert not entropy.requires_grad
    (expected * weights).sum().backward()
    (logp * weights).sum().backward()
    assert chunked.grad.dtype == dtype
    assert torch.equal(chunked.grad, reference.grad)


def test_log_probs_of_no_positions():
    logits = torch.zeros(0, 4, 9, requires_grad=True)
    ids = torch.zeros(0, 4, dtype=torch.long)
    logp, entropy = selective_log_softmax_and_entropy(logits, ids)
    assert logp.shape == entropy.shape == entropy_from_logits(logits).shape == (0, 4)


def test_entropy_uniform_and_peaked():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert entropy_from_logits(logits).tolist()[0] == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_pivotal_mask():
    turn_index = torch.tensor([[-1, 0, 0, -1, 1, 1, -1, 2], [-1, 0, 0, -1, 1, 1, -1, 2]])
    pivot = torch.tensor([2, 0])
    mask = pivotal_mask(turn_index, pivot)
    assert mask.int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 1], [0, 1, 1, 0, 1, 1, 0, 1]]


def test_pivotal_mask_no_pivot_keeps_assistant_tokens():
    turn_index = torch.tensor([[-1, 0, 1, -1]])
    assert pivotal_mask(turn_index, torch.tensor([-1])).int().tolist() == [[0, 1, 1, 0]]


def test_kl_estimators_hand_computed():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    d = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + d - 1)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_full_kl_hand_computed():
    student = torch.log(torch.tensor([[[0.5, 0.5]]]))
    teacher = torch.log(torch.tensor([[[0.25, 0.75]]]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert full_kl(student, teacher).item() == pytest.approx(expected, rel=1e-6)


def test_pg_loss_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    out = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), "pg")
    assert out.per_token.tolist() == [[2.0, -2.0]]
    out.per_token.sum().backward()
    assert logp.grad.tolist() == [[-2.0, 1.0]]
    assert out.ratio is None


def test_ppo_clip_hand_computed():
    # ratios: e^0.5≈1.6487 (A>0, clipped to 1.2), e^-0.5≈0.6065 (A<0 -> clip to 0.8, min picks -0.8*-1... )
    logp = torch.tensor([[0.5, -0.5, 0.1]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    out = policy_loss(logp, old, adv, torch.ones(1, 3), "ppo_clip", eps_low=0.2, eps_high=0.2)
    r = [math.exp(0.5), math.exp(-0.5), math.exp(0.1)]
    expected = [-min(r[0], 1.2), -min(-r[1], -0.8), -r[2]]
    assert out.per_token.tolist()[0] == pytest.approx(expected, rel=1e-6)
    assert out.clipped.tolist() == [[True, True, False]]


def test_ppo_clip_higher_asymmetric():
    logp = torch.tensor([[0.25]])
    out = policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), "ppo_clip", eps_low=0.2, eps_high=0.28)
    assert out.per_token.item() == pytest.approx(-min(math.exp(0.25), 1.28))


def test_gspo_sequence_ratio_and_gradient():
    logp = torch.tensor([[0.2, 0.0, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is padding: excluded from the ratio
    adv = torch.ones(1, 3)
    out = policy_loss(logp, old, adv, mask, "gspo", eps_low=1.0, eps_high=1.0)
    s = math.exp(0.1)
    assert out.ratio[0, :2].tolist() == pytest.approx([s, s], rel=1e-6)
    (out.per_token * mask).sum().backward()
    assert logp.grad[0, :2].tolist() == pytest.approx([-s, -s], rel=1e-6)


def test_shaped_off_policy_loss():
    logp = torch.log(torch.tensor([[0.1, 0.9]]))
    adv = torch.tensor([[1.0, 1.0]])
    out = shaped_off_policy_loss(logp, adv, gamma=0.1)
    assert out.tolist()[0] == pytest.approx([-0.5, -0.9])


def test_sft_nll():
    assert sft_nll(torch.tensor([[-0.5, -2.0]])).tolist() == [[0.5, 2.0]]


def test_aggregation_modes_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", 4, 2).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_mean", 4, 2).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_sum", 4, 2).item() == pytest.approx((6 + 4) / 2)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_sum_to_full_batch(mode):
    torch.manual_seed(0)
    per_token = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    tokens, seqs = mask.sum().item(), 6.0
    full = aggregate(per_token, mask, mode, tokens, seqs)
    parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], mode, tokens, seqs) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
