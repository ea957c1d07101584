"""The LightningModule: policy, optional frozen reference, an RL head and an SFT head.

``training_step`` reads top to bottom: the step's phase (``model.phases``, ``PhaseSchedule.at``) names
its producer, the warm-start's demonstrations or the datamodule's rollouts of the step's tasks with the
current weights (either gives a ``StepRollout``; the first step of ReflectRL's distillation phase first
takes its frozen teacher, ``r3lightning.training.distillation``), ``make_experience`` turns them into an
ExperienceBatch (R³'s ranking then adjusts its failures' advantages from this module's entropies),
``optimize`` updates in micro-batches with manual optimization, and the step returns a ``StepOutput``
(its metrics, trajectories and experience), which Lightning hands to the callbacks. Every loss is normalized by the *global* number of loss
tokens (or sequences) of the step, all-reduced over ranks, so the result does not depend on how the
batch was split into micro-batches or ranks. The forwards are in ``r3lightning.training.forward``, the loss in
``r3lightning.training.loss``. The module uses the datamodule through ``connect``, ``rollout``, ``demonstrations`` and
``evaluate`` (and ``tokenizer_corpus`` when it trains an in-memory tokenizer): docs/design.md, "One training step".
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import time
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.algos.premise import gradient_variance
from r3lightning.training.checkpoint_state import allow_in_checkpoints, check_loadable, r3lightning_section
from r3lightning.training.checkpoint_state import check_checkpoint_state
from r3lightning.training.distillation import Distillation, saved_state
from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
from r3lightning.data.evaluation import validation_figures, validation_names
from r3lightning.data.experience import make_experience
from r3lightning.data.failure_ranking import RankingActivity, rank_failed_rows
from r3lightning.data.step_rollout import StepRollout
from r3lightning.training.forward import PrefixSharedForward, window_start
from r3lightning.training.loss import loss_diagnostics, loss_terms, teacher_kl, update_statistics
from r3lightning.training.attention import use_training_attention
from r3lightning.training.models import ModelConfig, apply_chat_template_setting, apply_lora, build_tiny_model, build_tokenizer, load_pretrained
from r3lightning.training.optim import OptimConfig, scheduled_learning_rate, sum_gradients_over_ranks
from r3lightning.training.phases import Phase, PhaseSchedule
from r3lightning.engines.base import RolloutEngine
from r3lightning.engines.config import EngineConfig, build_engine
from r3lightning.rollout.metrics import experience_metrics, objective_activity, trajectory_metrics
from r3lightning.types import ExperienceBatch, StepOutput


class R3LightningModule(L.LightningModule):
    """Policy + RL head + SFT head, trained with manual optimization.

    Example: GRPO on single-digit arithmetic with a tiny policy built in memory, two steps on a CPU
    (``r3l fit --config recipe.yaml`` builds the same pair from YAML)::

        import lightning as L

        from r3lightning.algos.objective import AlgorithmConfig
        from r3lightning.data.datamodule import RolloutDataModule
        from r3lightning.engines.base import SamplingParams
        from r3lightning.envs.math_env import MathSuite
        from r3lightning.module import R3LightningModule
        from r3lightning.rollout.agent_loop import AgentLoopConfig
        from r3lightning.training.models import ModelConfig, TinyModelSpec

        policy = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=128, vocab_size=400)
        module = R3LightningModule(model=ModelConfig(tiny=policy), algorithm=AlgorithmConfig(advantage="grpo"))
        data = RolloutDataModule(
            MathSuite(source="arithmetic", num_val_tasks=4),
            group_size=4,
            tasks_per_step=2,
            sampling=SamplingParams(max_new_tokens=6),
            agent=AgentLoopConfig(action_format="raw"),
        )
        trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False)
        trainer.fit(module, data)

    Args:
        model: which policy to train (a hub/local model, or a tiny model built from a spec).
        algorithm: the RL objective (advantage, amplification, credit, policy loss, KL, aggregation).
        optim: optimizer, clipping and micro-batching.
        phases: the run's phases in order: the SFT warm-start on demonstrations, then RL, then (off by
            default) ReflectRL's distillation.
        engine: rollout engine.
        log_entropy: compute the policy entropy on loss tokens every step (in the same pass over the logits
            as the log-probs: a log-softmax per position more).
        max_bad_steps: stop after this many consecutive steps with non-finite loss or gradients.
        log_grad_variance: log the variance of the policy loss's gradient across the step's micro-batches
            (``train/policy_grad_var``, ``train/policy_grad_var_rel``, ``train/policy_grad_chunks``:
            ``r3lightning.algos.premise.gradient_variance``), the premise of R³L's pivotal credit. Costs
            one more backward of the policy loss per micro-batch and a copy of the gradient; needs two
            or more micro-batches with RL tokens (``optim.micro_batch_size``); not under FSDP (0 chunks).
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        algorithm: AlgorithmConfig = AlgorithmConfig(),
        optim: OptimConfig = OptimConfig(),
        phases: PhaseSchedule = PhaseSchedule(),
        engine: EngineConfig = EngineConfig(),
        log_entropy: bool = True,
        max_bad_steps: int = 5,
        log_grad_variance: bool = False,
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
        self.log_grad_variance = log_grad_variance
        self.automatic_optimization = False
        self.policy: Optional[torch.nn.Module] = None
        self.reference: Optional[torch.nn.Module] = None
        self.tokenizer = None
        self.engine: Optional[RolloutEngine] = None
        self.skipped_steps = 0
        self.consecutive_bad_steps = 0
        self.set_teacher(None)
        self.distillation = Distillation()
        # R³'s ranking activity of the last RL step that ranked (logged by every RL step with the ranking on).
        self.last_ranking = RankingActivity()
        self.prefix_forward = PrefixSharedForward()
        # One MeanMetric per validation figure (``data.evaluation.validation_names``), made for the first
        # validation batch (it says how many samples per task); averaged over tasks and ranks.
        self.val_metrics = torch.nn.ModuleDict()

    # ---- construction -------------------------------------------------------------------------
    @property
    def datamodule(self) -> RolloutDataModule:
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, RolloutDataModule):
            raise TypeError("R3LightningModule needs a RolloutDataModule (data: in the config)")
        return dm

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._check_schedule()
            Distillation.check(self.phases.distill, self.model_config.pretrained)
        self.prefix_forward.sharded = isinstance(self.trainer.strategy, FSDPStrategy)

    def _check_schedule(self) -> None:
        """The task stream is endless: a run needs ``trainer.max_steps``; the phases must play what they
        ask for (``PhaseSchedule.check``), and a warm-start as long as the run, which leaves no RL step, is
        allowed (an SFT-only run) but said once."""
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            raise ValueError(
                f"trainer.max_steps is {max_steps}: the task stream never ends, so set trainer.max_steps to the "
                "number of optimizer steps to run"
            )
        warning = self.phases.check(max_steps)
        if warning:
            rank_zero_warn(warning)

    def configure_model(self) -> None:
        if self.policy is None:
            if self.model_config.pretrained:
                policy, tokenizer = load_pretrained(self.model_config)
            else:
                tokenizer = build_tokenizer(self.datamodule.tokenizer_corpus(), self.model_config.tiny.vocab_size)
                apply_chat_template_setting(tokenizer, self.model_config)
                policy = build_tiny_model(self.model_config.tiny, tokenizer, seed=0)
            self._install(policy, tokenizer)
        self.datamodule.connect(self.engine, self.tokenizer, self.algorithm, self.phases.demonstrations(), self.phases.distill_start)

    def _install(self, policy: torch.nn.Module, tokenizer) -> None:
        use_training_attention(policy)
        if self.model_config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if self.algorithm.kl_coef > 0 and self.model_config.lora_rank <= 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self.policy = apply_lora(policy, self.model_config)
        self.tokenizer = tokenizer
        self.engine = build_engine(self.engine_config, self.policy, tokenizer, self.datamodule.context_budget())

    def use_engine(self, engine: RolloutEngine) -> None:
        """Roll out with ``engine`` from now on (tests swap in scripted engines this way)."""
        self.engine = engine
        self.datamodule.connect(engine, self.tokenizer, self.algorithm, self.phases.demonstrations(), self.phases.distill_start)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        cfg = self.optim_config
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))

    def learning_rate(self) -> float:
        max_steps = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        return scheduled_learning_rate(self.global_step, self.optim_config, self.phase, max_steps)

    @property
    def phase(self) -> Phase:
        """The phase of the current optimizer step (``model.phases``)."""
        return self.phases.at(self.global_step)

    # ---- the training step ----------------------------------------------------------------------
    def training_step(self, batch: TaskBatch, batch_idx: int) -> StepOutput:
        phase, step = self.phase, self.global_step
        if phase.name == "distill" and not self.distillation.begun:
            self.distillation.begin(self)  # the frozen teacher, before the phase's first rollout
        # The phase's producer: RL rolls the step's tasks out, the warm-start plays their demonstrations.
        produce = self.datamodule.rollout if phase.is_rl else self.datamodule.demonstrations
        if not getattr(self.engine, "needs_weight_sync", False):  # a synced engine's version is its sync count
            self.stamp_weight_version(step)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        rollout = produce(batch)
        timings["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        experience, trajectories = make_experience(rollout, self.algorithm, self.tokenizer.pad_token_id)
        if phase.is_rl:
            self.rank_failures(experience, rollout)
        timings["reward"] = time.perf_counter() - start
        start = time.perf_counter()
        stats = self.optimize(experience)
        timings["train"] = time.perf_counter() - start
        metrics = self.step_metrics(phase, rollout, experience, stats, timings)
        self.log_step_metrics(metrics, step)
        # Lightning hands this to every callback's ``on_train_batch_end`` as ``outputs``.
        return StepOutput(loss=torch.tensor(metrics["train/loss"]), metrics=metrics, trajectories=trajectories, experience=experience)

    def stamp_weight_version(self, version: int) -> None:
        """The one writer of ``engine.weight_version``, the version of the weights the engine samples with
        (trajectories record it, checkpoints save it): the optimizer step for an engine that shares the
        policy's weights (each step), the sync count for one they are streamed into (``VLLMWeightSync``,
        after each sync), the saved one when a checkpoint is restored."""
        self.engine.weight_version = version

    def log_step_metrics(self, metrics: dict[str, float], step: int) -> None:
        """The step's scalars straight to the loggers at ``step`` (the optimizer steps before this one),
        so a tag this step did not compute has a gap there: Lightning's own ``log`` re-emits every key
        logged earlier in the epoch, and the task stream is one endless epoch. ``self.log`` (no logger)
        still feeds the progress bar and ``trainer.callback_metrics``."""
        self.log_dict(metrics, on_step=True, batch_size=1, logger=False)
        if self._trainer is None or self.trainer.sanity_checking:
            return
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)

    def step_metrics(
        self, phase: Phase, rollout: StepRollout, experience: ExperienceBatch, stats: dict[str, float], timings: dict[str, float]
    ) -> dict[str, float]:
        """Everything a step logs: timings and throughput, the exploration's figures (RL steps), the
        optimizer's statistics, the batch's token counts and the components' activity (docs/monitoring.md)."""
        exploration = rollout.exploration
        metrics = {"time/rollout_s": timings["rollout"], **exploration.metrics}
        if phase.is_rl:
            metrics["time/reward_s"] = timings["reward"]
            metrics.update(trajectory_metrics(exploration.groups))
            generated = sum(t.num_response_tokens for t in exploration.trajectories)
            metrics["perf/rollout_tokens_per_s"] = generated / max(timings["rollout"], 1e-9)
            if hasattr(self.engine, "metrics"):
                metrics.update(self.engine.metrics())
            if self.algorithm.ranking.enabled:
                metrics.update(self.last_ranking.metrics())
            metrics.update(objective_activity(experience, self.algorithm, rollout.max_reward))
        metrics.update(stats)
        metrics["time/train_s"] = timings["train"]
        metrics["perf/train_tokens_per_s"] = float(experience.attention_mask.sum()) / max(timings["train"], 1e-9)
        metrics.update(experience_metrics(experience))
        metrics["train/phase_rl"] = float(phase.is_rl)
        if self.phases.distill.enabled:
            metrics.update(self.distillation.step_metrics(self))
        return {k: float(v) for k, v in metrics.items()}

    # ---- R³'s ranking of failures ----------------------------------------------------------------
    def rank_failures(self, experience: ExperienceBatch, rollout: StepRollout) -> None:
        """With ``algorithm.ranking.enabled``, R³'s structural-entropy ranking bonus for the failed RL rows of
        ``experience``. Entropies come from the trainer's own forward over those rows (at the sampling
        temperature), so they do not depend on the engine."""
        groups = rollout.exploration.groups
        rl_rows = sum(len(g.trajectories) for g in groups)
        if not self.algorithm.ranking.enabled or rl_rows == 0:
            return
        entropy = self.prefix_forward.response_entropy(
            self.policy, experience.slice(0, rl_rows), self.optim_config.micro_batch_size, self.device
        )
        ranking = self.algorithm.ranking
        generator = None
        if ranking.order == "placebo":  # the control's random order: reproducible per (seed, step, rank)
            generator = torch.Generator().manual_seed(rollout.seed + 3)
        self.last_ranking = rank_failed_rows(
            experience, groups, entropy, self.algorithm, rollout.max_reward, generator, self._step_success_floor(experience, rollout)
        )

    def _step_success_floor(self, experience: ExperienceBatch, rollout: StepRollout) -> Optional[float]:
        """The lowest success advantage of the step over every rank (the ranking's cap: no failure above
        any success of the step); None on one rank, where the ranking takes its own rows'."""
        if self._trainer is None or self.trainer.world_size <= 1:
            return None
        rl = rollout.exploration.trajectories
        advantages = experience.sequence_advantages[: len(rl)]
        success = torch.tensor([t.reward >= rollout.max_reward for t in rl], dtype=torch.bool)
        lowest = float(advantages[success].min()) if success.any() else math.inf
        value = torch.tensor(lowest, device=self.device, dtype=torch.float64)  # every rank takes part
        return float(self.trainer.strategy.reduce(value, reduce_op=torch.distributed.ReduceOp.MIN).item())

    # ---- optimization -------------------------------------------------------------------------
    def _reduce_sum(self, value: float) -> float:
        tensor = torch.tensor(float(value), device=self.device)
        if self.trainer.world_size > 1:
            tensor = self.trainer.strategy.reduce(tensor, reduce_op="sum")
        return float(tensor.item())

    def optimize(self, experience: ExperienceBatch) -> dict[str, float]:
        """Micro-batched update over ``experience``; returns the step's training metrics."""
        cfg = self.algorithm
        optimizer = self.optimizers()
        if self.phases.rl_begins_after_warmstart(self.global_step):
            if self.phases.rl.reset_optimizer:
                optimizer.optimizer.state.clear()
            self._anchor_reference_to_policy()
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate()
        micro_batches = experience.micro_batches(self.optim_config.micro_batch_size)
        self.prefix_forward.reset_counts()
        need_ref = cfg.kl_coef > 0 and self.phase.is_rl
        self.prefix_forward.fill_logprobs(
            experience, micro_batches, self.policy, self.reference, cfg.recompute_old_logprobs, need_ref, self.device
        )
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
            gradients = PolicyGradientChunks() if self.log_grad_variance and not isinstance(self.trainer.strategy, FSDPStrategy) else None
            for rows in micro_batches:
                micro = experience.take(rows).to(self.device)
                losses = self.micro_batch_loss(micro, totals)
                if gradients is not None and "loss_rl" in losses and losses["loss_rl"].requires_grad and micro.loss_mask[:, 1:].any():
                    gradients.add(losses["loss_rl"], self.policy)
                self.manual_backward(losses["loss"] * scale)
                for name, value in losses.items():
                    value = float(value.detach())
                    sums[name] = max(sums.get(name, value), value) if name == "ratio_max" else sums.get(name, 0.0) + value
            if self._sums_gradients_itself() and self.trainer.world_size > 1:
                sum_gradients_over_ranks([p for p in self.policy.parameters() if p.requires_grad])
            stats = self._finish_update(optimizer, sums, float(rl_mask.sum()))
            if self.log_grad_variance:
                stats.update(gradients.figures() if gradients is not None else {"train/policy_grad_chunks": 0.0})
        stats["perf/train_forward_token_frac"] = self.prefix_forward.token_fraction()
        stats["perf/train_prefix_sharing_off"] = float(self.prefix_forward.sharing_off)
        return stats

    def _anchor_reference_to_policy(self) -> None:
        """Make the KL reference the warm-started policy at the first RL step. RLHF's convention is a KL
        to the SFT model; the weights from before the warm-start (random, for a tiny model) are no anchor.
        With LoRA the reference stays the base model with adapters disabled."""
        if self.reference is None:
            return
        if isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError(
                "kl_coef > 0 after a warm-start under FSDP: the reference cannot be re-anchored to the "
                "sharded warm-started policy; run the warm-start separately and start RL from its checkpoint "
                "with model.phases.warmstart.steps: 0"
            )
        self.reference.load_state_dict(self.policy.state_dict())

    def _sums_gradients_itself(self) -> bool:
        return self._trainer is not None and isinstance(self.trainer.model, torch.nn.parallel.DistributedDataParallel)

    def on_train_start(self) -> None:
        if self._sums_gradients_itself():
            # DDP's reducer expects exactly one backward per forward; a step here runs a backward per
            # micro-batch inside one forward. Gradients are summed by ``optimize`` (``sum_gradients_over_ranks``).
            self.trainer.model.require_backward_grad_sync = False
        if self.phases.distill.enabled:
            self.distillation.on_train_start(self)

    # ---- a frozen teacher (ReflectRL's reflective-to-direct distillation) -----------------------
    @property
    def teacher(self) -> Optional[torch.nn.Module]:
        """A frozen copy of an earlier policy whose KL the RL loss also pays; not a submodule, so it
        stays out of the module's state dict (the distillation phase saves it: ``training.distillation``)."""
        return self.__dict__.get("_teacher")

    def set_teacher(
        self,
        teacher: Optional[torch.nn.Module],
        coef: float = 0.0,
        estimator: str = "exact",
        contexts: Optional[Mapping[tuple[int, ...], Sequence[int]]] = None,
    ) -> None:
        """Add ``coef · KL(π_θ ‖ π_teacher)`` on the RL tokens to the loss (``estimator``: ``exact`` over
        the vocabulary, or ``sampled``: the k3 estimate from the sampled tokens' log-probs).

        ``contexts`` (context distillation): the teacher's prompt token ids keyed by the student's
        prompt token ids (a row's tokens before its first generated one). A row whose prompt is a key
        is scored by the teacher under that prompt, on the same response tokens; others under their
        own prompt (counted: ``distill/teacher_context_rate``). None: every row under its own prompt."""
        if estimator not in ("exact", "sampled"):
            raise ValueError(f"teacher KL estimator must be 'exact' or 'sampled', got {estimator!r}")
        if teacher is not None:
            teacher.eval().requires_grad_(False)
        self.__dict__["_teacher"] = teacher
        self.teacher_kl_coef = coef
        self.teacher_kl_estimator = estimator
        self.teacher_contexts = contexts

    def micro_batch_loss(self, micro: ExperienceBatch, totals: dict[str, float]) -> dict[str, torch.Tensor]:
        """Loss terms of one micro-batch, each already divided by the global counts, and their diagnostics."""
        if micro.input_ids.shape[1] < 2:
            # Nothing to predict (every episode here ended before its first token: prompts longer than the
            # context). A zero loss through an ordinary forward keeps DDP/FSDP gradient reduction in step.
            dummy = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
            return {"loss": self.policy(input_ids=dummy, attention_mask=torch.ones_like(dummy)).logits.sum() * 0.0}
        # Predictions before ``start`` carry no loss (prompts): not computed, every per-token tensor starts there.
        start = window_start(micro)
        logp, logits, entropy = self.prefix_forward.sequence_logprobs(self.policy, micro, start, with_entropy=self.log_entropy)
        kl_to_teacher, in_context = None, 0
        if totals["rl_tokens"] > 0 and self.teacher is not None and self.teacher_kl_coef > 0:
            with torch.no_grad():
                teacher_logits, in_context = self.prefix_forward.teacher_logits(
                    self.teacher, micro, logits, start, self.teacher_contexts, self.tokenizer.pad_token_id
                )
            kl_to_teacher = teacher_kl(logp, logits, teacher_logits, micro, start, self.teacher_kl_estimator)
        sft_weight = self.algorithm.sft_weight if self.phase.is_rl else 1.0
        terms = loss_terms(micro, logp, logits, start, self.algorithm, totals, sft_weight, kl_to_teacher, self.teacher_kl_coef)
        return {**terms.losses, **loss_diagnostics(micro, logp, entropy, start, terms, in_context)}

    def _finish_update(self, optimizer, sums: dict[str, float], rl_tokens: float) -> dict[str, float]:
        """Clip, step (or skip a non-finite step) and the update's figures; ``rl_tokens``: this rank's RL loss tokens."""
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
            **update_statistics(sums, rl_tokens),
        }
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
        """Whether this is a periodic validation of ``fit`` that falls in a phase that does not validate
        (``model.phases.warmstart.validate`` off; ``r3l validate`` always validates)."""
        fitting = self._trainer is None or self.trainer.state.fn == "fit"
        return fitting and not self.phase.validate

    def validation_step(self, batch: TaskBatch, batch_idx: int) -> None:
        """Greedy and ``batch.val_samples`` sampled episodes per task; the figures of
        ``data.evaluation.validation_figures``, weighted by the batch's tasks."""
        if self.skips_validation:
            return
        names = validation_names(batch.val_samples)
        if list(self.val_metrics) != names:
            self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in names}).to(self.device)
        direct = self.validation_view
        greedy = self.datamodule.evaluate(batch.tasks, greedy=True, direct=direct)
        sampled = self.datamodule.evaluate(batch.tasks, greedy=False, samples=batch.val_samples, direct=direct)
        for name, value in validation_figures(greedy, sampled, batch.val_samples).items():
            self.val_metrics[name].update(value, weight=len(batch.tasks))

    @property
    def validation_view(self) -> Optional[bool]:
        """With a distillation phase, whether validation shows the questions directly (once the phase has
        begun) or with their golden negative (stage 1); None without one (the suite's own view)."""
        return self.distillation.begun if self.phases.distill.enabled else None

    def on_validation_epoch_end(self) -> None:
        if self.skips_validation:
            return
        if self.phases.distill.enabled:
            self.distillation.validate_direct(self)
        for name, metric in self.val_metrics.items():
            self.log(f"val/{name}", metric.compute(), prog_bar=name == "success_rate_greedy")
            metric.reset()

    def on_validation_end(self) -> None:
        if self.phases.distill.enabled:
            self.distillation.record_validation(self)

    def on_fit_end(self) -> None:
        if self.phases.distill.enabled:
            self.distillation.report(self)

    # ---- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["r3lightning"] = r3lightning_section(
            self.phase.name,
            self.engine.weight_version if self.engine else 0,
            self.skipped_steps,
            self.tokenizer,
            self.model_config,
            in_memory_tokenizer=not self.model_config.pretrained,
        )
        if self.phases.distill.enabled:
            checkpoint["r3lightning"]["distill"] = self.distillation.state_dict(self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before it restores anything: the whole restorable state is checked here.
        check_checkpoint_state(checkpoint, getattr(self._trainer, "ckpt_path", None), self._trainer)
        saved = check_loadable(checkpoint, self.state_dict(), self.tokenizer, self.phases)
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        if self.engine is not None:
            self.stamp_weight_version(int(saved.get("weight_version", 0)))
        distill, _ = saved_state(checkpoint, take=True)  # an old callback's state too (docs/reflectrl.md)
        if distill is not None and self.phases.distill.enabled:
            config = self.distillation.load_state_dict(distill, self.phases.distill, self.phases.distill_start)
            self.phases = dataclasses.replace(self.phases, distill=config)
        elif distill is not None and distill.get("phase") == "distill":
            rank_zero_warn("the checkpoint is in ReflectRL's distillation phase, but model.phases.distill.enabled is false: "
                           "this run goes on without its teacher and with the suite's own tasks")


# ``R3LightningModule.load_from_checkpoint`` loads before any instance exists: allow the default configs' types.
allow_in_checkpoints(*(p.default for p in inspect.signature(R3LightningModule.__init__).parameters.values()))


class PolicyGradientChunks:
    """The policy loss's gradient per micro-batch, kept as ‖g_m‖² and the running sum Σ g_m (one copy of
    the trainable parameters), for ``gradient_variance`` (``R3LightningModule.log_grad_variance``)."""

    def __init__(self) -> None:
        self.sq_norms: list[float] = []
        self.total: Optional[list[torch.Tensor]] = None

    def add(self, loss_rl: torch.Tensor, policy: torch.nn.Module) -> None:
        params = [p for p in policy.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss_rl, params, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
        self.sq_norms.append(sum(float(g.double().pow(2).sum()) for g in grads))
        self.total = [g.clone() for g in grads] if self.total is None else [t.add_(g) for t, g in zip(self.total, grads)]

    def figures(self) -> dict[str, float]:
        figures = {"train/policy_grad_chunks": float(len(self.sq_norms))}
        if len(self.sq_norms) >= 2:
            total_sq = sum(float(t.double().pow(2).sum()) for t in self.total)
            variance, relative = gradient_variance(torch.tensor(self.sq_norms, dtype=torch.float64), total_sq)
            figures["train/policy_grad_var"] = variance
            figures["train/policy_grad_var_rel"] = relative
        return figures
