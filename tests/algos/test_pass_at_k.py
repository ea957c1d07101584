from math import comb

import pytest
import torch

from r3lightning.algos.pass_at_k import mean_at_k, pass_at_k, summarize


def test_hand_computed_cases():
    # (n, c, k): expected
    cases = {
        (5, 2, 2): 1 - 3 / 10,  # 1 - C(3,2)/C(5,2)
        (4, 0, 4): 0.0,  # k = n, nothing correct
        (4, 4, 1): 1.0,  # everything correct
        (5, 4, 2): 1.0,  # n - c = 1 < k: every pair contains a correct sample
        (10, 1, 1): 0.1,  # pass@1 = c / n
        (10, 3, 10): 1.0,  # k = n with one success or more
        (6, 1, 3): 1 - 10 / 20,  # 1 - C(5,3)/C(6,3)
    }
    for (n, c, k), expected in cases.items():
        assert pass_at_k([n], [c], k).tolist() == pytest.approx([expected], abs=1e-12), (n, c, k)


def test_per_task_vector_with_mixed_sample_counts():
    got = pass_at_k(torch.tensor([5, 8, 3]), torch.tensor([2, 0, 3]), 2)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert got.tolist() == pytest.approx([0.7, 0.0, 1.0], abs=1e-12)


def test_matches_binomials_for_large_n():
    # The product form stays finite where C(n, k) has hundreds of digits.
    n, c, k = 1000, 7, 100
    expected = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k([n], [c], k).item() == pytest.approx(expected, rel=1e-12)


def test_mean_at_k_is_fraction_correct():
    assert mean_at_k([5, 4], [2, 4], 3).tolist() == pytest.approx([0.4, 1.0])


@pytest.mark.parametrize(
    "n, c, k, name",
    [
        ([4], [1], 5, "k=5"),
        ([4], [5], 1, "num_correct"),
        ([4], [-1], 1, "num_correct"),
        ([4], [1], 0, "k"),
        ([0], [0], 1, "num_samples"),
    ],
)
def test_invalid_arguments_name_the_argument(n, c, k, name):
    for fn in (pass_at_k, mean_at_k):
        with pytest.raises(ValueError, match=name):
            fn(n, c, k)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="num_samples .* num_correct"):
        pass_at_k([4, 4], [1], 1)


def test_summarize():
    correct = [
        [True, False, False, True, False],  # c = 2
        [False] * 5,  # c = 0
        [True] * 5,  # c = 5
    ]
    out = summarize(correct, ks=[1, 2, 5, 16])
    assert set(out) == {"pass@1", "pass@2", "pass@5", "mean@5"}  # 16 > n is left out
    assert out["pass@1"] == pytest.approx((0.4 + 0 + 1) / 3)
    assert out["pass@2"] == pytest.approx((0.7 + 0 + 1) / 3)
    assert out["pass@5"] == pytest.approx((1 + 0 + 1) / 3)
    assert out["mean@5"] == pytest.approx((0.4 + 0 + 1) / 3)


def test_summarize_rejects_ragged_or_empty():
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([[True], [True, False]], ks=[1])
    with pytest.raises(ValueError, match="no tasks"):
        summarize([], ks=[1])
