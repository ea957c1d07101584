"""Engine selection from config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from r3lightning.rollout.engine import RolloutEngine
from r3lightning.rollout.hf_engine import HFEngine


@dataclass
class EngineConfig:
    """Rollout engine.

    Args:
        backend: ``hf`` (generate on the live policy; no sync needed).
        max_batch_size: prompts per generate call.
    """

    backend: Literal["hf"] = "hf"
    max_batch_size: int = 64


def build_engine(config: EngineConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    """The engine ``config`` names, generating with ``policy``'s weights."""
    if config.backend == "hf":
        return HFEngine(policy, tokenizer, max_batch_size=config.max_batch_size)
    raise ValueError(f"engine.backend: unknown backend {config.backend!r}")
