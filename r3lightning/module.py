"""The LightningModule: policy, optional frozen reference, an RL head and an SFT head.

``training_step`` receives a TaskBatch, rolls it out with the current weights (through the
datamodule), turns groups into an ExperienceBatch with ``algos``, and optimizes it in micro-batches
with manual optimization. Every loss is normalized by the *global* number of loss tokens (or
sequences) of the step, all-reduced over ranks, so the result does not depend on how the batch was
split into micro-batches or ranks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torchmetrics import MeanMetric

from r3lightning import algos
from r3lightning.data.collate import collate_experience
from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
from r3lightning.models import (
    ModelConfig,
    apply_lora,
    build_tiny_model,
    build_tokenizer,
    load_pretrained,
    tokenizer_fingerprint,
)
from r3lightning.rollout.engine import RolloutEngine
from r3lightning.rollout.engines import EngineConfig, build_engine
from r3lightning.rollout.metrics import experience_metrics, trajectory_metrics
from r3lightning.types import ExperienceBatch, Group, Trajectory


@dataclass
class AlgorithmConfig:
    """The RL objective: a composition of orthogonal knobs (docs/algorithms.md).

    Args:
        advantage: group estimator: grpo | dr_grpo | rloo | opmd | reinforce | raft.
        adv_eps: epsilon added to the group std (grpo).
        success_threshold: reward at or above which a sample counts as a success (raft, metrics).
        positive_amplification: R³L positive amplification of positive advantages.
        alpha: amplification factor.
        max_reward: reward that counts as the maximum for amplification.
        max_reward_mode: value given to max-reward samples: ``alpha`` (paper) or ``one`` (reference code).
        pivotal_credit: mask turns before each trajectory's pivot (R³L); off = trajectory-level credit.
        policy_loss: pg (no ratio) | ppo_clip | gspo.
        clip_eps_low: lower clip range of the ratio.
        clip_eps_high: upper clip range of the ratio (> low is DAPO's clip-higher).
        kl_coef: weight of the KL penalty to the frozen reference: the policy as RL starts (after the
            SFT warm-start, if any). 0 disables the reference model.
        kl_estimator: k1 | k2 | k3.
        aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum.
        sft_weight: weight of the SFT head's NLL (meta-tasks, demonstrations, GNT reflections).
        sft_aggregation: token_mean (every SFT token weighs the same) | seq_mean_token_mean (every SFT
            sample weighs the same, so a few long reflections do not drown many short action turns).
        off_policy_gamma: γ of Critique-GRPO's policy shaping π/(π+γ) on off-policy refinements.
        recompute_old_logprobs: recompute behaviour log-probs with the trainer before updating (needed
            for ratios when the engine's numerics differ from the trainer's, or for replayed samples).
        update_epochs: passes over each batch (more than 1 makes the importance ratio move away from 1).
        mask_truncated: give truncated samples no RL loss (overlong filtering).
    """

    advantage: Literal["grpo", "dr_grpo", "rloo", "opmd", "reinforce", "raft"] = "grpo"
    adv_eps: float = 1e-6
    success_threshold: float = 1.0
    positive_amplification: bool = False
    alpha: float = 3.0
    max_reward: float = 1.0
    max_reward_mode: Literal["alpha", "one"] = "alpha"
    pivotal_credit: bool = False
    policy_loss: Literal["pg", "ppo_clip", "gspo"] = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    sft_weight: float = 1.0
    sft_aggregation: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    off_policy_gamma: float = 0.1
    recompute_old_logprobs: bool = False
    update_epochs: int = 1
    mask_truncated: bool = False


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
            In the quickstart's setting it stopped a late collapse of the RL phase (docs/results.md).
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


def allow_in_checkpoints(*configs: Any) -> None:
    """Allow the config dataclasses in ``configs`` (and those nested in them) in ``torch.load(weights_only=True)``.

    Checkpoints store the module's init arguments as hyper-parameters; Lightning resumes
    (``fit(ckpt_path=...)``) with torch's default ``weights_only=True`` loader, which refuses any class
    it was not told about, so without this a module built in Python could not resume from its own
    checkpoint. Only these plain config dataclasses are allowed, nothing executable.
    """
    found: set[type] = set()
    stack = list(configs)
    while stack:
        value = stack.pop()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in found:
                found.add(type(value))
                stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    if found:
        torch.serialization.add_safe_globals(sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


class R3LightningModule(L.LightningModule):
    """Policy + RL head + SFT head, trained with manual optimization.

    Args:
        model: which policy to train (a hub/local model, or a tiny model built from a spec).
        algorithm: the RL objective (advantage, amplification, credit, policy loss, KL, aggregation).
        optim: optimizer, clipping and micro-batching.
        phases: SFT warm-start then RL.
        engine: rollout engine.
        log_entropy: compute the policy entropy on loss tokens every step (costs one softmax pass).
        max_bad_steps: stop after this many consecutive steps with non-finite loss or gradients.
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        algorithm: AlgorithmConfig = AlgorithmConfig(),
        optim: OptimConfig = OptimConfig(),
        phases: PhaseConfig = PhaseConfig(),
        engine: EngineConfig = EngineConfig(),
        log_entropy: bool = True,
        max_bad_steps: int = 5,
    ) -> None:
        super().__init__()
        allow_in_checkpoints(model, algorithm, optim, phases, engine)
        self.save_hyperparameters()
        self.model_config = model
        self.algorithm = algorithm
        self.optim_config = optim
        self.phases = phases
        self.engine_config = engine
        self.log_entropy = log_entropy
        self.max_bad_steps = max_bad_steps
        self.automatic_optimization = False
        self.policy: Optional[torch.nn.Module] = None
        self.reference: Optional[torch.nn.Module] = None
        self.tokenizer = None
        self.engine: Optional[RolloutEngine] = None
        self.skipped_steps = 0
        self.consecutive_bad_steps = 0
        self.last_experience: Optional[ExperienceBatch] = None
        self.last_trajectories: list[Trajectory] = []
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ("success_rate", "success_rate_greedy", "reward_mean")}
        )

    # ---- construction -------------------------------------------------------------------------
    @property
    def datamodule(self) -> RolloutDataModule:
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, RolloutDataModule):
            raise TypeError("R3LightningModule needs a RolloutDataModule (data: in the config)")
        return dm

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        if self.model_config.name_or_path:
            policy, tokenizer = load_pretrained(self.model_config)
        else:
            tokenizer = build_tokenizer(self.datamodule.tokenizer_corpus(), self.model_config.tiny.vocab_size)
            policy = build_tiny_model(self.model_config.tiny, tokenizer, seed=0)
        self._install(policy, tokenizer)

    def _install(self, policy: torch.nn.Module, tokenizer) -> None:
        if self.model_config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if self.algorithm.kl_coef > 0 and self.model_config.lora_rank <= 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self.policy = apply_lora(policy, self.model_config)
        self.tokenizer = tokenizer
        self.engine = build_engine(self.engine_config, self.policy, tokenizer)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        cfg = self.optim_config
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))

    def learning_rate(self) -> float:
        max_steps = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        return scheduled_learning_rate(self.global_step, self.optim_config, self.phases.sft_warmup_steps, max_steps)

    # ---- phases -------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return "sft" if self.global_step < self.phases.sft_warmup_steps else "rl"

    @property
    def sampling_temperature(self) -> float:
        temperature = self.datamodule.sampling.temperature
        return temperature if temperature > 0 else 1.0

    # ---- the training step ----------------------------------------------------------------------
    def training_step(self, batch: TaskBatch, batch_idx: int) -> None:
        dm = self.datamodule
        dm.mark_consumed(batch)
        if not getattr(self.engine, "needs_weight_sync", False):  # a synced engine's version is its sync count
            self.engine.weight_version = self.global_step
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        if self.phase == "sft":
            trajectories = dm.demonstrations(batch, self.engine, self.tokenizer)
            experience = collate_experience(trajectories, [0.0] * len(trajectories), self.tokenizer.pad_token_id)
            metrics["time/rollout_s"] = time.perf_counter() - start
        else:
            exploration = dm.explore(batch, self.engine, self.tokenizer)
            metrics["time/rollout_s"] = time.perf_counter() - start
            start = time.perf_counter()
            experience, trajectories = self.build_experience(exploration.groups, exploration.sft)
            metrics["time/reward_s"] = time.perf_counter() - start
            metrics.update(exploration.metrics)
            metrics.update(trajectory_metrics(exploration.groups, self.algorithm.success_threshold))
            metrics["perf/rollout_tokens_per_s"] = sum(t.num_response_tokens for t in trajectories) / max(
                metrics["time/rollout_s"], 1e-9
            )
            if hasattr(self.engine, "metrics"):
                metrics.update(self.engine.metrics())
        self.last_trajectories = trajectories
        self.last_experience = experience
        start = time.perf_counter()
        metrics.update(self.optimize(experience))
        metrics["time/train_s"] = time.perf_counter() - start
        metrics["perf/train_tokens_per_s"] = float(experience.attention_mask.sum()) / max(metrics["time/train_s"], 1e-9)
        metrics.update(experience_metrics(experience))
        metrics["train/phase_rl"] = float(self.phase == "rl")
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, batch_size=1)

    def build_experience(self, groups: list[Group], sft: list[Trajectory]) -> tuple[ExperienceBatch, list[Trajectory]]:
        """Advantages for every RL trajectory (per group), then collation with the SFT samples."""
        rl = [t for g in groups for t in g.trajectories]
        group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
        rewards = torch.tensor([t.reward for t in rl], dtype=torch.float32)
        advantages = self.compute_advantages(rewards, group_index, rl)
        trajectories = rl + list(sft)
        experience = collate_experience(
            trajectories,
            advantages.tolist() + [0.0] * len(sft),
            self.tokenizer.pad_token_id,
            pivotal_credit=self.algorithm.pivotal_credit,
        )
        if self.algorithm.mask_truncated:
            truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool).unsqueeze(1)
            experience.loss_mask = experience.loss_mask.masked_fill(truncated, 0.0)
            experience.advantages = experience.advantages * experience.loss_mask
        return experience, trajectories

    def compute_advantages(self, rewards: torch.Tensor, group_index: torch.Tensor, trajectories: list[Trajectory]) -> torch.Tensor:
        """Per-trajectory advantages [N] from rewards [N] and group ids [N]; errored samples are excluded."""
        if rewards.numel() == 0:
            return rewards
        cfg = self.algorithm
        valid = torch.tensor([not t.reward_error for t in trajectories], dtype=torch.bool)
        advantages = torch.zeros_like(rewards)
        if valid.any():
            advantages[valid] = algos.compute_advantages(
                rewards[valid], group_index[valid], cfg.advantage, eps=cfg.adv_eps, success_threshold=cfg.success_threshold
            )
        if cfg.positive_amplification:
            advantages = algos.positive_amplification(
                advantages, rewards, cfg.alpha, cfg.max_reward, cfg.max_reward_mode
            ) * valid
        return advantages

    # ---- optimization -------------------------------------------------------------------------
    def _reduce_sum(self, value: float) -> float:
        tensor = torch.tensor(float(value), device=self.device)
        if self.trainer.world_size > 1:
            tensor = self.trainer.strategy.reduce(tensor, reduce_op="sum")
        return float(tensor.item())

    def sequence_logprobs(self, model: torch.nn.Module, batch: ExperienceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [b, T-1] of tokens 1.. at the sampling temperature, the model's own logits [b, T-1, V])."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        return algos.selective_log_softmax(self.tempered(logits), batch.input_ids[:, 1:]), logits

    def tempered(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of the sampling distribution (the RL loss scores the samples as they were drawn)."""
        return logits / self.sampling_temperature if self.sampling_temperature != 1.0 else logits

    @torch.no_grad()
    def _fill_logprobs(self, experience: ExperienceBatch, micro_batches: list[torch.Tensor]) -> None:
        """Reference log-probs (KL) and recomputed behaviour log-probs, one no-grad pass each."""
        cfg = self.algorithm
        need_ref = cfg.kl_coef > 0 and self.phase == "rl"
        if not need_ref and not cfg.recompute_old_logprobs:
            return
        width = experience.input_ids.shape[1]
        ref = torch.zeros_like(experience.old_logprobs) if need_ref else None
        for rows in micro_batches:
            micro = experience.take(rows).to(self.device)
            cols = micro.input_ids.shape[1]
            if cols < 2:  # no token to score (episodes that ended before their first turn)
                continue
            if cfg.recompute_old_logprobs:
                logp, _ = self.sequence_logprobs(self.policy, micro)
                experience.old_logprobs[rows, 1:cols] = logp.float().cpu()
            if need_ref:
                ref_model = self.reference if self.reference is not None else self.policy
                context = self.policy.disable_adapter() if self.reference is None else contextlib.nullcontext()
                with context:
                    logp, _ = self.sequence_logprobs(ref_model, micro)
                ref[rows, 1:cols] = logp.float().cpu()
        if ref is not None:
            experience.ref_logprobs = ref[:, :width]

    def optimize(self, experience: ExperienceBatch) -> dict[str, float]:
        """Micro-batched update over ``experience``; returns the step's training metrics."""
        cfg = self.algorithm
        optimizer = self.optimizers()
        if 0 < self.phases.sft_warmup_steps == self.global_step:
            if self.phases.reset_optimizer_for_rl:
                optimizer.optimizer.state.clear()
            self._anchor_reference_to_policy()
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate()
        micro_batches = experience.micro_batches(self.optim_config.micro_batch_size)
        self._fill_logprobs(experience, micro_batches)
        rl_mask = experience.loss_mask[:, 1:]
        totals = {
            "rl_tokens": self._reduce_sum(rl_mask.sum()),
            "rl_seqs": self._reduce_sum((rl_mask.sum(-1) > 0).sum()),
            "sft_tokens": self._reduce_sum(experience.sft_mask[:, 1:].sum()),
            "sft_seqs": self._reduce_sum((experience.sft_mask[:, 1:].sum(-1) > 0).sum()),
        }
        # Every loss is a global sum / global count, so the gradients of all ranks must be *summed*.
        # Under DDP we do that ourselves once per step (below); FSDP averages, so undo its mean.
        scale = 1.0 if self._sums_gradients_itself() else float(self.trainer.world_size)
        stats: dict[str, float] = {}
        for _ in range(max(cfg.update_epochs, 1)):
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for rows in micro_batches:
                micro = experience.take(rows).to(self.device)
                losses = self.micro_batch_loss(micro, totals)
                self.manual_backward(losses["loss"] * scale)
                for name, value in losses.items():
                    value = float(value.detach())
                    sums[name] = max(sums.get(name, value), value) if name == "ratio_max" else sums.get(name, 0.0) + value
            self._sum_gradients_over_ranks()
            stats = self._finish_update(optimizer, sums)
        return stats

    def _anchor_reference_to_policy(self) -> None:
        """Make the KL reference the warm-started policy at the first RL step. RLHF's convention is a KL
        to the SFT model; the weights from before the warm-start (random, for a tiny model) are no anchor.
        With LoRA the reference stays the base model with adapters disabled."""
        if self.reference is None:
            return
        if isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError(
                "kl_coef > 0 with sft_warmup_steps > 0 under FSDP: the reference cannot be re-anchored to the "
                "sharded warm-started policy; run the warm-start separately and start RL from its checkpoint "
                "with sft_warmup_steps: 0"
            )
        self.reference.load_state_dict(self.policy.state_dict())

    def _sums_gradients_itself(self) -> bool:
        return self._trainer is not None and isinstance(self.trainer.model, torch.nn.parallel.DistributedDataParallel)

    def on_train_start(self) -> None:
        if self._sums_gradients_itself():
            # DDP's reducer expects exactly one backward per forward; a step here runs a backward per
            # micro-batch inside one forward. Gradients are summed by _sum_gradients_over_ranks.
            self.trainer.model.require_backward_grad_sync = False

    def _sum_gradients_over_ranks(self) -> None:
        """All-reduce (sum) every trainable gradient in one flat buffer; missing ones count as zero so
        every rank sends the same layout."""
        if not self._sums_gradients_itself() or self.trainer.world_size == 1:
            return
        params = [p for p in self.policy.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)

    def micro_batch_loss(self, micro: ExperienceBatch, totals: dict[str, float]) -> dict[str, torch.Tensor]:
        """Loss terms of one micro-batch, each already divided by the global counts."""
        cfg = self.algorithm
        if micro.input_ids.shape[1] < 2:
            # Nothing to predict (every episode here ended before its first token: prompts longer than the
            # context). A zero loss through an ordinary forward keeps DDP/FSDP gradient reduction in step.
            dummy = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
            return {"loss": self.policy(input_ids=dummy, attention_mask=torch.ones_like(dummy)).logits.sum() * 0.0}
        logp, logits = self.sequence_logprobs(self.policy, micro)
        mask = micro.loss_mask[:, 1:]
        sft_mask = micro.sft_mask[:, 1:]
        advantages = micro.advantages[:, 1:]
        out: dict[str, torch.Tensor] = {}
        zero = logp.sum() * 0.0
        if totals["rl_tokens"] > 0:
            off_policy = torch.tensor([o == "off_policy" for o in micro.origins], device=logp.device).unsqueeze(1)
            # An off-policy refinement was sampled in another context (with its critique), so its behaviour
            # log-probs say nothing about these tokens: its rows take the shaping loss below, and the ratio
            # of their unused branch is pinned to 1, since an inf there would still turn gradients to NaN.
            old_logprobs = torch.where(off_policy, logp.detach(), micro.old_logprobs[:, 1:])
            result = algos.policy_loss(
                logp, old_logprobs, advantages, mask, cfg.policy_loss, cfg.clip_eps_low, cfg.clip_eps_high
            )
            per_token = result.per_token
            if off_policy.any():
                shaped = algos.shaped_off_policy_loss(logp, advantages, cfg.off_policy_gamma)
                per_token = torch.where(off_policy, shaped, per_token)
            out["loss_rl"] = algos.aggregate(per_token, mask, cfg.aggregation, totals["rl_tokens"], totals["rl_seqs"])
            if result.ratio is not None:
                m = mask.bool() & ~off_policy
                out["ratio_sum"] = (result.ratio * m).sum().detach()
                out["ratio_max"] = (result.ratio * m).max().detach() if m.any() else zero.detach()
                out["clip_count"] = (result.clipped & m).sum().detach().float()
                out["ratio_count"] = m.sum().detach().float()
            with torch.no_grad():
                # log pi_theta - log pi_behaviour per origin: ~0 for fresh samples (engine and trainer agree),
                # the context-distillation gap for distilled rows (sampled with guidance, scored without).
                logratio = logp - micro.old_logprobs[:, 1:]
                scored = mask.bool() & torch.isfinite(logratio)
                logratio = torch.where(scored, logratio, 0.0)
                for origin in sorted(set(micro.origins)):
                    rows = torch.tensor([o == origin for o in micro.origins], device=logp.device)
                    count = scored[rows].sum()
                    if count > 0:
                        out[f"logratio_sum/{origin}"] = logratio[rows].sum()
                        out[f"logratio_count/{origin}"] = count.float()
            if cfg.kl_coef > 0 and micro.ref_logprobs is not None:
                kl = algos.kl_estimate(logp, micro.ref_logprobs[:, 1:], cfg.kl_estimator)
                out["loss_kl"] = cfg.kl_coef * algos.aggregate(kl, mask, "token_mean", totals["rl_tokens"], totals["rl_seqs"])
                out["kl_ref_sum"] = (kl.detach() * mask).sum()
        if totals["sft_tokens"] > 0:
            weight = cfg.sft_weight if self.phase == "rl" else 1.0
            # The SFT head fits the model's own distribution, not the tempered sampling one; taken from the
            # untempered logits, the warm-start is bit-for-bit the same whatever the sampling temperature.
            sft_logp = logp
            if self.sampling_temperature != 1.0:
                sft_logp = algos.selective_log_softmax(logits, micro.input_ids[:, 1:])
            nll = algos.aggregate(
                algos.sft_nll(sft_logp), sft_mask, cfg.sft_aggregation, totals["sft_tokens"], totals["sft_seqs"]
            )
            out["loss_sft"] = weight * nll
        if self.log_entropy:
            with torch.no_grad():
                ent = algos.entropy_from_logits(self.tempered(logits))
                scored = torch.maximum(mask, sft_mask)
                out["entropy_sum"] = (ent * scored).sum()
                out["entropy_count"] = scored.sum()
        out["loss"] = sum((out[k] for k in ("loss_rl", "loss_kl", "loss_sft") if k in out), zero)
        return out

    def _finish_update(self, optimizer, sums: dict[str, float]) -> dict[str, float]:
        clip = self.optim_config.grad_clip
        max_norm = clip if clip > 0 else float("inf")
        wrapped = self.trainer.model
        if hasattr(wrapped, "clip_grad_norm_"):
            # FSDP: the norm must be reduced over shards, which only the wrapper knows how to do.
            grad_norm = wrapped.clip_grad_norm_(max_norm)
        else:
            params = [p for p in self.policy.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        finite = math.isfinite(sums.get("loss", 0.0)) and bool(torch.isfinite(grad_norm))
        stats = {
            "train/loss": sums.get("loss", 0.0),
            "train/grad_norm": float(grad_norm),
            "train/lr": optimizer.param_groups[0]["lr"],
        }
        for name in ("loss_rl", "loss_sft", "loss_kl"):
            if name in sums:
                stats[f"train/{name}"] = sums[name]
        if "entropy_count" in sums:
            stats["train/entropy"] = sums["entropy_sum"] / max(sums["entropy_count"], 1.0)
        rl_tokens = float(self.last_experience.loss_mask[:, 1:].sum()) if self.last_experience is not None else 0.0
        if "kl_ref_sum" in sums:
            stats["train/kl_ref"] = sums["kl_ref_sum"] / max(rl_tokens, 1.0)
        for name in sums:
            if name.startswith("logratio_sum/"):
                origin = name.split("/", 1)[1]
                stats[f"train/logratio_{origin}"] = sums[name] / sums[f"logratio_count/{origin}"]
        if "ratio_sum" in sums:
            # Over the tokens that have a ratio: off-policy refinements have none.
            stats["train/ratio_mean"] = sums["ratio_sum"] / max(sums["ratio_count"], 1.0)
            stats["train/ratio_max"] = sums["ratio_max"]
            stats["train/clip_frac"] = sums["clip_count"] / max(sums["ratio_count"], 1.0)
        if finite:
            optimizer.step()
            self.consecutive_bad_steps = 0
        else:
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_bad_steps += 1
            if self.consecutive_bad_steps >= self.max_bad_steps:
                self.trainer.should_stop = True
                self.print(
                    f"[r3lightning] stopping: {self.consecutive_bad_steps} consecutive steps had non-finite "
                    "loss or gradients (see train/skipped_steps)"
                )
        stats["train/skipped_steps"] = float(self.skipped_steps)
        return stats

    # ---- validation ---------------------------------------------------------------------------
    @property
    def skips_validation(self) -> bool:
        """Whether this validation falls in the warm-start and ``phases.validate_during_sft`` is off."""
        return not self.phases.validate_during_sft and self.global_step < self.phases.sft_warmup_steps

    def validation_step(self, batch: TaskBatch, batch_idx: int) -> None:
        if self.skips_validation:
            return
        dm = self.datamodule
        greedy = dm.evaluate(batch.tasks, self.engine, self.tokenizer, greedy=True)
        sampled = dm.evaluate(batch.tasks, self.engine, self.tokenizer, greedy=False)
        n = len(batch.tasks)
        self.val_metrics["success_rate_greedy"].update(sum(t.success for t in greedy) / n, weight=n)
        self.val_metrics["success_rate"].update(sum(t.success for t in sampled) / n, weight=n)
        self.val_metrics["reward_mean"].update(sum(t.reward for t in sampled) / n, weight=n)

    def on_validation_epoch_end(self) -> None:
        if self.skips_validation:
            return
        for name, metric in self.val_metrics.items():
            self.log(f"val/{name}", metric.compute(), prog_bar=name == "success_rate_greedy")
            metric.reset()

    # ---- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["r3lightning"] = {
            "phase": self.phase,
            "weight_version": self.engine.weight_version if self.engine else 0,
            "skipped_steps": self.skipped_steps,
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
            "tokenizer_json": self.tokenizer.backend_tokenizer.to_str() if not self.model_config.name_or_path else None,
            "model_config": repr(self.model_config),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("r3lightning")
        if saved is None:
            raise ValueError("checkpoint was not written by r3lightning (no 'r3lightning' section)")
        if saved["tokenizer_fingerprint"] != tokenizer_fingerprint(self.tokenizer):
            raise ValueError(
                "checkpoint: its tokenizer differs from this run's (changed model or task suite?). "
                "Resume with the configuration the checkpoint was trained with."
            )
        own = self.state_dict()
        mismatched = [
            k for k, v in checkpoint["state_dict"].items() if k in own and tuple(own[k].shape) != tuple(v.shape)
        ]
        missing = [k for k in own if k not in checkpoint["state_dict"] and not k.startswith("val_metrics")]
        no_reference = [k for k in missing if k.startswith("reference.")]
        if no_reference:
            warm_up = self.phases.sft_warmup_steps
            if 0 < warm_up < checkpoint.get("global_step", 0):
                raise ValueError(
                    f"checkpoint: it has no reference model (trained with kl_coef 0) and is past the warm-start "
                    f"(step {checkpoint['global_step']} > sft_warmup_steps {warm_up}), so the warm-started policy "
                    "the KL should anchor to is not in it. Resume with kl_coef: 0, or from a checkpoint saved "
                    f"by step {warm_up}."
                )
            # Before the first RL step the reference is either the initial model (rebuilt identically by
            # configure_model) or about to be anchored to the warm-started policy: this run's own will do.
            for key in no_reference:
                checkpoint["state_dict"][key] = own[key]
            missing = [k for k in missing if not k.startswith("reference.")]
        if mismatched or missing:
            example = (mismatched or missing)[0]
            raise ValueError(
                f"checkpoint: model does not match this configuration ({len(mismatched)} parameters with other "
                f"shapes, {len(missing)} missing; e.g. {example!r}). Saved model config: {saved['model_config']}"
            )
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        if self.engine is not None:
            self.engine.weight_version = int(saved.get("weight_version", 0))


# ``R3LightningModule.load_from_checkpoint`` loads before any instance exists: allow the default configs' types.
allow_in_checkpoints(*(p.default for p in inspect.signature(R3LightningModule.__init__).parameters.values()))
