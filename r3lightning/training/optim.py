"""Optimizer settings, training phases, the learning rate as a pure function of the step, and the
gradients' sum over ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch


@dataclass
class OptimConfig:
    """Optimizer and step mechanics.

    Args:
        lr: AdamW learning rate of the RL phase.
        sft_lr: learning rate during the SFT warm-start phase (null: same as lr).
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
    sft_lr: Optional[float] = None
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


@dataclass
class PhaseConfig:
    """Training phases of one ``fit`` run.

    Args:
        sft_warmup_steps: optimizer steps of SFT on demonstrations before RL starts.
        reset_optimizer_for_rl: clear the optimizer's state (AdamW's moments) at the first RL step, as
            a separate SFT-then-RL pipeline would. Cross-entropy gradients are several times larger
            than policy-gradient ones (0.3 vs 0.08-0.15 in the quickstart), and the second moment
            they leave behind decays over ~1/(1 - beta2) = 1000 steps: until then every RL update
            is divided by the SFT gradients' scale, a silent cut of RL's learning rate.
        validate_during_sft: run the trainer's periodic validations during the warm-start too. Off,
            validations before step ``sft_warmup_steps`` are skipped, so the first one measures the
            finished warm-start (make ``sft_warmup_steps`` a multiple of ``trainer.val_check_interval``).
            Validation forks the CPU random stream, so on CPU skipping it leaves training unchanged.
    """

    sft_warmup_steps: int = 0
    reset_optimizer_for_rl: bool = True
    validate_during_sft: bool = True


def scheduled_learning_rate(step: int, optim: OptimConfig, sft_steps: int, total_steps: Optional[int] = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based), a pure function of the step so that resuming
    needs no scheduler state: ``optim.sft_lr`` for steps < ``sft_steps`` (``optim.lr`` when unset),
    then ``optim.lr``, each phase opening with a linear warm-up over ``optim.warmup_steps`` (the RL
    phase may start from a freshly reset optimizer, whose first AdamW steps are the largest).

    With ``optim.lr_decay == "cosine"`` each phase then decays along a half cosine towards
    ``optim.min_lr_ratio`` of its rate, reached one step after the phase's last: the SFT phase spans
    ``sft_steps`` steps, the RL phase ``total_steps - sft_steps``."""
    in_sft = step < sft_steps
    step_in_phase = step if in_sft else step - sft_steps
    warmup = max(optim.warmup_steps, 0)
    warm_up = min(1.0, (step_in_phase + 1) / (warmup + 1))
    rate = optim.sft_lr if in_sft and optim.sft_lr is not None else optim.lr
    if optim.lr_decay == "cosine":
        if not in_sft and (total_steps is None or total_steps <= sft_steps):
            raise ValueError(
                f"optim.lr_decay=cosine needs the run's length: trainer.max_steps ({total_steps}) must exceed "
                f"phases.sft_warmup_steps ({sft_steps})"
            )
        phase_steps = sft_steps if in_sft else total_steps - sft_steps
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
