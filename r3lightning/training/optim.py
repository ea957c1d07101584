"""Optimizer settings, the learning rate as a pure function of the step and its phase, and the
gradients' sum over ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from r3lightning.training.phases import Phase


@dataclass
class OptimConfig:
    """Optimizer and step mechanics.

    Args:
        lr: AdamW learning rate (of the RL phase, and of the warm-start unless
            ``model.phases.warmstart.lr`` sets its own).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up steps.
        grad_clip: max global gradient norm (0 disables clipping).
        micro_batch_size: sequences per forward/backward pass.
        lr_decay: learning-rate shape after each phase's warm-up: ``constant`` or ``cosine`` (down to
            ``min_lr_ratio`` of the phase's rate at the phase's last step; needs ``trainer.max_steps``).
            In the quickstart's setting it stopped a late collapse of the RL phase
            (benchmarks/results/NOTEBOOK.md).
        min_lr_ratio: floor of the cosine decay, as a fraction of the phase's rate, in [0, 1].
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    lr_decay: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def scheduled_learning_rate(step: int, optim: OptimConfig, phase: Phase, total_steps: Optional[int] = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based) in ``phase``, a pure function of the step so
    that resuming needs no scheduler state: the phase's own rate (``optim.lr`` when it sets none), opening
    with a linear warm-up over ``optim.warmup_steps`` (the RL phase may start from a freshly reset
    optimizer, whose first AdamW steps are the largest). The warm-up and decay count over the phase's
    ``schedule`` (RL and a distillation after it share one).

    With ``optim.lr_decay == "cosine"`` the phase then decays along a half cosine towards
    ``optim.min_lr_ratio`` of its rate, reached one step after the phase's last (the last phase ends
    with the run, at ``total_steps``)."""
    first, end = phase.schedule
    step_in_phase = step - first
    warmup = max(optim.warmup_steps, 0)
    warm_up = min(1.0, (step_in_phase + 1) / (warmup + 1))
    rate = phase.lr if phase.lr is not None else optim.lr
    if optim.lr_decay == "cosine":
        end = end if end is not None else total_steps
        if end is None or end <= first:
            raise ValueError(
                f"optim.lr_decay=cosine needs the run's length: trainer.max_steps ({total_steps}) must exceed "
                f"the {phase.name} phase's first step ({first})"
            )
        phase_steps = end - first
        progress = min(1.0, max(0, step_in_phase - warmup) / max(1, phase_steps - warmup))
        floor = optim.min_lr_ratio
        rate *= floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return rate * warm_up


def sum_gradients_over_ranks(params: list[torch.nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of ``params`` in one flat buffer; missing ones count as zero so
    every rank sends the same layout."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)
