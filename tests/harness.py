"""The shared test harness: the tiny model every test trains, a quiet trainer, the module/datamodule
pair of a short CPU run, the algorithm presets as the real ``r3l`` parser builds them, a tiny policy's
agent loop over any suite, and worker processes with a deadline.

Importable as ``harness`` because pytest's ``pythonpath`` includes ``tests/``. The fixtures built from
these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
from r3lightning.envs.math_env import MathSuite
from r3lightning.training.models import ModelConfig, TinyModelSpec, build_tiny_model, build_tokenizer
from r3lightning.module import R3LightningModule
from r3lightning.training.optim import OptimConfig
from r3lightning.training.phases import PhaseSchedule, WarmStartPhase
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.types import StepOutput, step_output

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# The recipe fragments (algorithm presets, trainer and engine files) are stacked on in tests.
BASE_RECIPE = CONFIGS / "examples" / "grpo_arithmetic_cpu.yaml"

# One transformer block, 2 query heads of width 32 sharing one key/value head; the tokenizer is
# trained to at most 400 tokens on the suite's texts.
TINY_SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)
# Two blocks, for what needs more than one decoder layer (FSDP wraps each layer in its own unit).
TWO_LAYER_SPEC = replace(TINY_SPEC, num_layers=2)

# Single-turn arithmetic with the bare question as prompt: the default suite of training tests.
ARITHMETIC = dict(source="arithmetic", num_val_tasks=4, instruction="")
# TextWorld games small enough to generate in about a second each (the ``textworld_suite`` fixture).
TEXTWORLD_SETTINGS = dict(world_size=2, nb_objects=3, quest_length=2, num_train_games=2, num_val_tasks=1, max_turns=6)
# One ScienceWorld task, with gold paths of 10-12 actions (the ``scienceworld_suite`` fixture).
SCIENCEWORLD_TASK = "find-living-thing"

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0, limit_val_batches=0,
)

# A whole `r3l` recipe (as YAML would give it) of one quiet CPU step of the TINY_SPEC policy on
# arithmetic: what tests run through `r3lightning.cli.main` in-process.
TINY_CLI_RUN = {
    "seed_everything": 0,
    "trainer": {"max_steps": 1, "logger": False, "enable_progress_bar": False},
    "model": {
        "model": {"tiny": {k: getattr(TINY_SPEC, k) for k in ("hidden_size", "num_layers", "num_attention_heads",
                                                               "num_key_value_heads", "intermediate_size", "vocab_size")}},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip"},
        "optim": {"lr": 1.0e-3, "micro_batch_size": 8},
    },
    "data": {
        "suite": {"class_path": "r3lightning.envs.math_env.MathSuite",
                  "init_args": {"source": "arithmetic", "num_val_tasks": 2, "instruction": ""}},
        "group_size": 2,
        "tasks_per_step": 2,
        "val_tasks_per_batch": 2,
        "sampling": {"max_new_tokens": 3},
        "val_sampling": {"max_new_tokens": 3},
        "agent": {"action_format": "raw", "max_context_tokens": 64},
    },
}


def quiet_trainer(max_steps: int, **overrides) -> L.Trainer:
    """A Trainer for ``max_steps`` steps with no logger, checkpoints, progress bar, model summary or
    validation; ``overrides`` replace any of these (``limit_val_batches=1``, ``logger=...``) or add
    other Trainer arguments (``callbacks``, ``default_root_dir``, ``strategy``...)."""
    return L.Trainer(max_steps=max_steps, **{**QUIET, **overrides})


class LastStep(L.Callback):
    """Keeps the last training step's ``StepOutput`` (``training_step``'s return value, the ``outputs`` of
    ``on_train_batch_end``: its metrics, trajectories and experience) for a test to read after ``fit``."""

    def __init__(self) -> None:
        self.output: StepOutput = step_output(None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.output = step_output(outputs)


def module_and_data(
    suite=None,
    *,
    algorithm: AlgorithmConfig | None = None,
    model: ModelConfig | None = None,
    lr: float = 1e-3,
    micro_batch_size: int = 8,
    warmup_steps: int = 0,
    sft_steps: int = 0,
    group_size: int = 4,
    tasks_per_step: int = 2,
    max_new_tokens: int = 6,
    agent: AgentLoopConfig | None = None,
    explorer=None,
    seed: int = 0,
    **module_kwargs,
) -> tuple[R3LightningModule, RolloutDataModule]:
    """The (module, datamodule) pair of a short CPU run.

    Defaults: ``suite`` single-turn arithmetic (``ARITHMETIC``), groups of 4, two tasks a step, 6 new
    tokens, raw actions in 128-token contexts, the ``explorer``'s default (plain sampling); the
    ``TINY_SPEC`` policy trained by plain policy gradient with AdamW at ``lr`` 1e-3 in micro-batches
    of 8, no warm-up, no SFT warm-start. ``module_kwargs`` go to ``R3LightningModule`` (``max_bad_steps``).
    """
    data = RolloutDataModule(
        suite if suite is not None else MathSuite(**ARITHMETIC),
        explorer=explorer,
        group_size=group_size,
        tasks_per_step=tasks_per_step,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        agent=agent or AgentLoopConfig(action_format="raw", max_context_tokens=128),
        seed=seed,
    )
    module = R3LightningModule(
        model=model or ModelConfig(tiny=TINY_SPEC),
        algorithm=algorithm or AlgorithmConfig(policy_loss="pg"),
        optim=OptimConfig(lr=lr, micro_batch_size=micro_batch_size, warmup_steps=warmup_steps),
        phases=PhaseSchedule(WarmStartPhase(steps=sft_steps)),
        **module_kwargs,
    )
    return module, data


def weights_changed(module, seed: int = 0) -> list[bool]:
    """Per parameter tensor: does the trained policy differ from the untrained one (``seed``'s init)?"""
    untrained = build_tiny_model(module.model_config.tiny, module.tokenizer, seed=seed)
    return [not torch.equal(a.cpu(), b) for a, b in zip(module.policy.parameters(), untrained.parameters())]


# ---- a tiny policy playing any suite -----------------------------------------------------------------
def suite_tokenizer(suite, num_tasks: int, agent: AgentLoopConfig | None = None):
    """The tokenizer ``configure_model`` would train for ``suite`` (its prompts and ``num_tasks``
    demonstrations, played once), at ``TINY_SPEC``'s vocabulary size."""
    return build_tokenizer(corpus_from_suite(suite, agent or AgentLoopConfig(), num_tasks=num_tasks), vocab_size=TINY_SPEC.vocab_size)


def tiny_loop(suite, tokenizer, agent: AgentLoopConfig | None = None) -> AgentLoop:
    """An agent loop over ``suite`` whose engine is a random ``TINY_SPEC`` policy (seed 0); ``agent``
    defaults to tagged actions in 8192-token contexts."""
    model = build_tiny_model(TINY_SPEC, tokenizer, seed=0)
    return AgentLoop(suite, HFEngine(model, tokenizer), tokenizer, agent or AgentLoopConfig(max_context_tokens=8192))


# ---- the real r3l parser -------------------------------------------------------------------------------
@functools.cache
def parse_only_cli():
    """``R3LightningCLI`` (the real subclass: its trainer defaults and every dataclass and class
    signature) after parsing ``fit --config BASE_RECIPE``, built once. It stops right after parsing:
    nothing is seeded, instantiated or trained, and no optional strategy package is imported. Parse
    more with ``parse_only_cli().parser.parse_args([...])``."""
    from r3lightning.cli.main import R3LightningCLI

    class Parsed(Exception):
        pass

    class ParseOnlyCLI(R3LightningCLI):
        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            raise Parsed(self)

    try:
        with mock.patch.object(sys, "argv", ["r3l"]):  # pytest's own argv would trigger a CLI warning
            ParseOnlyCLI(args=["fit", "--config", str(BASE_RECIPE)])
    except Parsed as stop:
        return stop.args[0]
    raise AssertionError("the CLI did not finish parsing")


def preset(name: str, recipe: Path = BASE_RECIPE):
    """(AlgorithmConfig, explorer) exactly as ``r3l fit --config RECIPE --config
    configs/algorithms/NAME.yaml`` builds them: parsed and instantiated by the real parser (the module
    and datamodule constructors run; no model is built)."""
    cli = parse_only_cli()
    config = cli.parser.parse_args(["fit", "--config", str(recipe), "--config", str(CONFIGS / "algorithms" / f"{name}.yaml")])
    built = cli.parser.instantiate(config).fit
    return built.model.algorithm, built.data.explorer


# ---- worker processes ----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a gloo process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, args, nprocs: int, timeout_s: float = 240) -> None:
    """``torch.multiprocessing.start_processes`` with a deadline: a hung worker fails the test instead
    of the whole run. Workers are forked (fast) unless vLLM was loaded here or a process group is
    initialized: vLLM's OpenMP/thread state makes forked children hang, so they are spawned then."""
    start_method = "spawn" if "vllm" in sys.modules or torch.distributed.is_initialized() else "fork"
    context = torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__}: workers did not finish within {timeout_s} s")
