"""Fixtures shared by the whole test tree; the helpers they use are in ``tests/harness.py``.

Suites, built once per session. Each ``make_*_suite`` is a factory for one small offline
configuration (call it again for a second instance of the same configuration; keyword arguments
override settings), and the fixture without ``make_`` is one instance of it:

- ``make_world_suite``, ``world_suite``: the procedural world (difficulty 1, 4 turns, 8 validation
  tasks), with ``world_tokenizer`` and a random ``TINY_SPEC`` ``world_policy`` (a fresh copy per test).
- ``make_textworld_suite``/``textworld_suite``, ``make_scienceworld_suite``/``scienceworld_suite``,
  ``make_alfworld_suite``/``alfworld_suite`` (on ``alfworld_data``, tiny hand-written games): they
  skip when the package, or Java for ScienceWorld, is missing.
- ``tiny_loops``: ``tiny_loops(suite, agent=None)`` is the agent loop (``harness.tiny_loop``) of a
  random ``TINY_SPEC`` policy over ``suite``, built once per suite and agent configuration (its
  tokenizer plays two demonstrations).
"""

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
# TINY_SPEC is also importable from here (``from conftest import TINY_SPEC``); its home is harness.
from harness import SCIENCEWORLD_TASK, TEXTWORLD_SETTINGS, TINY_SPEC, suite_tokenizer, tiny_loop

from r3lightning.training.models import build_tiny_model


@pytest.fixture(scope="session")
def make_world_suite():
    from r3lightning.envs.textworld_procedural import ProceduralWorldSuite

    return functools.partial(ProceduralWorldSuite, difficulty=1, num_val_tasks=8, max_turns=4)


@pytest.fixture(scope="session")
def world_suite(make_world_suite):
    return make_world_suite()


@pytest.fixture(scope="session")
def world_tokenizer(world_suite):
    return suite_tokenizer(world_suite, num_tasks=16)


@pytest.fixture()
def world_policy(world_tokenizer):
    return build_tiny_model(TINY_SPEC, world_tokenizer, seed=0)


@pytest.fixture(scope="session")
def make_textworld_suite(tmp_path_factory):
    pytest.importorskip("textworld")
    from r3lightning.envs.textworld_env import TextWorldSuite

    return functools.partial(TextWorldSuite, cache_dir=str(tmp_path_factory.mktemp("tw-cache")), **TEXTWORLD_SETTINGS)


@pytest.fixture(scope="session")
def textworld_suite(make_textworld_suite):
    return make_textworld_suite()


@pytest.fixture(scope="session")
def make_scienceworld_suite():
    pytest.importorskip("scienceworld")
    from r3lightning.envs import scienceworld_env

    try:
        scienceworld_env.require_java()
    except RuntimeError as err:  # no Java on this machine
        pytest.skip(str(err))
    return functools.partial(scienceworld_env.ScienceWorldSuite, task_names=[SCIENCEWORLD_TASK], num_val_per_task=1)


@pytest.fixture(scope="session")
def scienceworld_suite(make_scienceworld_suite):
    suite = make_scienceworld_suite()
    yield suite
    suite.close()


@pytest.fixture(scope="session")
def alfworld_data(tmp_path_factory):
    """A data folder of tiny hand-written games (``tests/alfworld_games.py``)."""
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    from alfworld_games import write_tiny_data

    return write_tiny_data(tmp_path_factory.mktemp("alfworld-data"))


@pytest.fixture(scope="session")
def make_alfworld_suite(alfworld_data):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    return functools.partial(ALFWorldSuite, data_dir=str(alfworld_data), task_types=["pick_and_place_simple"])


@pytest.fixture(scope="session")
def alfworld_suite(make_alfworld_suite):
    return make_alfworld_suite()


@pytest.fixture(scope="session")
def tiny_loops():
    loops = {}

    def loop_for(suite, agent=None):
        key = (id(suite), repr(agent))
        if key not in loops:
            tokenizer = suite_tokenizer(suite, num_tasks=2, agent=agent)
            loops[key] = (suite, tiny_loop(suite, tokenizer, agent))  # holding the suite keeps its id unique
        return loops[key][1]

    return loop_for
