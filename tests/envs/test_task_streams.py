"""The task streams' seeds and epoch shuffles: one implementation each (``r3lightning.envs.common``), and
the streams they give are the ones every recorded run was trained on (the formulas are restated here)."""

import hashlib
import random

from r3lightning.envs.common import derive_seed, finite_index, shuffled_range, split_seed
from r3lightning.envs.math_sources import FiniteSplit, MathItem


def test_derive_seed_is_the_32_bit_blake2b_of_the_parts():
    assert derive_seed(0, "epoch", 3) == int.from_bytes(hashlib.blake2b(repr((0, "epoch", 3)).encode(), digest_size=4).digest(), "little")
    assert derive_seed(7, "holdout") != derive_seed(8, "holdout")


def test_split_seed_is_twice_the_leading_sha256_bits_plus_the_split_parity():
    digest = hashlib.sha256(b"5:train:9").digest()
    assert split_seed(5, "train", 9) == 2 * (int.from_bytes(digest[:4], "big") >> 2)
    assert split_seed(5, "val", 9, bits=56) == 2 * int.from_bytes(hashlib.sha256(b"5:val:9").digest()[:7], "big") + 1


def test_shuffled_range_is_a_seeded_shuffle_of_range_n():
    order = list(range(10))
    random.Random("3:epoch:1").shuffle(order)
    assert shuffled_range("3:epoch:1", 10) == tuple(order)


def test_finite_index_walks_a_fresh_shuffle_per_epoch():
    n = 7
    for index in range(3 * n):
        order = list(range(n))
        random.Random(f"11:epoch:{index // n}").shuffle(order)
        assert finite_index(11, index, n) == order[index % n]


def test_a_finite_math_split_holds_out_and_shuffles_per_epoch_as_recorded_runs_did():
    items = [MathItem(key=f"row{i}", question=f"q{i}", answer=str(i)) for i in range(9)]
    split = FiniteSplit(items, num_val=3, seed=4, origin="test")
    order = list(range(9))
    random.Random(derive_seed(4, "holdout")).shuffle(order)
    train = [items[i] for i in order[3:]]
    assert split.val_items() == [items[i] for i in order[:3]]
    for index in range(2 * len(train) + 2):
        epoch, position = divmod(index, len(train))
        epoch_order = list(range(len(train)))
        random.Random(derive_seed(4, "epoch", epoch)).shuffle(epoch_order)
        assert split.train_item(index) == train[epoch_order[position]]
