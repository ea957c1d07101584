"""The premise gates' math (``r3lightning.algos.premise``) against hand-computed values."""

import math

import torch

from r3lightning.algos.premise import context_gain, gradient_variance, paired_success_sums


def test_paired_success_gain_and_its_standard_error():
    # 4 questions: with the GNT 1,0,0,1; without 0,1,0,1 -> d = 1,-1,0,0: mean 0, sample var 2/3.
    sums = paired_success_sums(torch.tensor([1.0, 0, 0, 1]), torch.tensor([0.0, 1, 0, 1]))
    assert sums.tolist() == [4.0, 2.0, 2.0, 2.0]
    figures = context_gain(sums)
    assert (figures["with"], figures["without"], figures["gain"], figures["questions"]) == (0.5, 0.5, 0.0, 4.0)
    assert math.isclose(figures["gain_se"], math.sqrt((2 / 3) / 4))
    # 3 questions: with 0,0,0; without 1,1,0 -> d = -1,-1,0: mean -2/3, sample var (2*(1/9) + 4/9)/2 = 1/3.
    figures = context_gain(paired_success_sums(torch.zeros(3), torch.tensor([1.0, 1, 0])))
    assert math.isclose(figures["gain"], -2 / 3) and math.isclose(figures["gain_se"], math.sqrt((1 / 3) / 3))


def test_sums_of_two_ranks_add_up_to_the_whole():
    a, b = torch.tensor([1.0, 0, 1, 1, 0]), torch.tensor([0.0, 0, 1, 0, 1])
    whole = context_gain(paired_success_sums(a, b))
    split = context_gain(paired_success_sums(a[:2], b[:2]) + paired_success_sums(a[2:], b[2:]))
    assert whole == split


def test_no_questions_and_one_question():
    empty = context_gain(paired_success_sums(torch.zeros(0), torch.zeros(0)))
    assert empty["questions"] == 0.0 and math.isnan(empty["gain"]) and math.isnan(empty["with"])
    one = context_gain(paired_success_sums(torch.ones(1), torch.zeros(1)))
    assert one["gain"] == 1.0 and math.isnan(one["gain_se"])


def test_gradient_variance_from_micro_batch_gradients():
    # g1 = (1, 0), g2 = (0, 1): chunk estimates 2*g = (2,0), (0,2) around G = (1,1); their sample
    # covariance trace is (2 + 2) / 1 = 4, and the mean of 2 estimates has 4 / 2 = 2; ||G||^2 = 2.
    grads = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    variance, relative = gradient_variance(grads.pow(2).sum(-1), float(grads.sum(0).pow(2).sum()))
    assert math.isclose(variance, 2.0) and math.isclose(relative, 1.0)
    # Identical chunks: no variance.
    same = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    assert gradient_variance(same.pow(2).sum(-1), float(same.sum(0).pow(2).sum())) == (0.0, 0.0)
    # Against the definition on random chunks.
    torch.manual_seed(0)
    g = torch.randn(5, 7, dtype=torch.float64)
    m, total = g.shape[0], g.sum(0)
    expected = ((m * g - total).pow(2).sum() / (m - 1) / m).item()
    variance, relative = gradient_variance(g.pow(2).sum(-1), float(total.pow(2).sum()))
    assert math.isclose(variance, expected) and math.isclose(relative, expected / float(total.pow(2).sum()))
    # One chunk: undefined.
    assert all(math.isnan(x) for x in gradient_variance(torch.tensor([1.0]), 1.0))
