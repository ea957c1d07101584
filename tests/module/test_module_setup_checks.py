"""Setup refusals of the module: what can be known before the first step."""

import pytest
from harness import module_and_data, quiet_trainer

from r3lightning.algos.objective import AlgorithmConfig, RankingConfig


def test_a_ranking_window_that_cannot_make_two_windows_is_refused():
    module, dm = module_and_data(algorithm=AlgorithmConfig(ranking=RankingConfig(enabled=True, window=4)), max_new_tokens=6)
    with pytest.raises(ValueError, match=r"ranking.window \(4\) cannot make two windows within data.sampling.max_new_tokens \(6\).*at most 3"):
        quiet_trainer(1).fit(module, dm)
