"""The LightningModule: policy, optional frozen reference, an RL head and an SFT head.

``training_step`` reads top to bottom: the datamodule rolls the step's tasks out with the current
weights (``rollout``), ``make_experience`` turns them into an ExperienceBatch, and ``optimize``
updates in micro-batches with manual optimization. Every loss is normalized by the *global* number of
loss tokens (or sequences) of the step, all-reduced over ranks, so the result does not depend on how
the batch was split into micro-batches or ranks.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from r3lightning import algos
from r3lightning.algos.context_distillation import aligned_predictions, prompt_lengths, splice_prompts
from r3lightning.algos.logprobs import scored_window_start
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.checkpoint_state import allow_in_checkpoints, check_loadable, r3lightning_section
from r3lightning.training.checkpoint_state import check_checkpoint_state
from r3lightning.data.collate import collate_experience
from r3lightning.data.combinations import check_combination
from r3lightning.data.datamodule import RolloutDataModule, TaskBatch
from r3lightning.data.evaluation import validation_figures, validation_names
from r3lightning.data.experience import make_experience
from r3lightning.data.failure_ranking import RankingActivity, rank_failures
from r3lightning.training.models import ModelConfig, apply_chat_template_setting, apply_lora, build_tiny_model, build_tokenizer, load_pretrained
from r3lightning.training.optim import OptimConfig, PhaseConfig, scheduled_learning_rate
from r3lightning.rollout.engine import RolloutEngine
from r3lightning.rollout.engine_config import EngineConfig, build_engine
from r3lightning.rollout.metrics import experience_metrics, objective_activity, trajectory_metrics
from r3lightning.types import ExperienceBatch, Group, Trajectory


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the sampling distribution (the RL loss scores the samples as they were drawn)."""
    return logits / temperature if temperature != 1.0 else logits


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
        self.set_teacher(None)
        self.last_ranking = RankingActivity()
        # The last training step's logged scalars (callbacks read them: ``trainer.callback_metrics`` keeps
        # stale values of tags a step did not log).
        self.last_step_metrics: dict[str, float] = {}
        # Training forwards: tokens run through the model vs in the rows (this step), and micro-batches whose
        # shared prefix had to be recomputed per row (the fallback, counted over the run).
        self.forward_tokens = {"forwarded": 0, "in_rows": 0}
        self.prefix_sharing_off = 0
        # One MeanMetric per validation figure (``data.evaluation.validation_names``), added in ``setup``
        # once the datamodule's ``val_samples`` is known; averaged over tasks and ranks.
        self.val_metrics = torch.nn.ModuleDict()

    # ---- construction -------------------------------------------------------------------------
    @property
    def datamodule(self) -> RolloutDataModule:
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, RolloutDataModule):
            raise TypeError("R3LightningModule needs a RolloutDataModule (data: in the config)")
        return dm

    def setup(self, stage: str) -> None:
        dm = self.datamodule
        if stage == "fit":
            self._check_schedule()
        names = validation_names(dm.val_samples)
        if list(self.val_metrics) != names:
            self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in names})
        for warning in check_combination(self.algorithm, dm.explorer, dm.demos.reflections):
            rank_zero_warn(warning)
        ranking = self.algorithm.ranking
        if ranking.enabled and 2 * ranking.window > dm.sampling.max_new_tokens:
            raise ValueError(
                f"model.algorithm.ranking.window ({ranking.window}) cannot make two windows within "
                f"data.sampling.max_new_tokens ({dm.sampling.max_new_tokens}): the stability score would be "
                f"undefined for every response; set the window to at most {dm.sampling.max_new_tokens // 2}"
            )

    def _check_schedule(self) -> None:
        """The task stream is endless: a run needs ``trainer.max_steps``; a warm-start as long as the run
        leaves no RL step, which is allowed (an SFT-only run) but said once."""
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            raise ValueError(
                f"trainer.max_steps is {max_steps}: the task stream never ends, so set trainer.max_steps to the "
                "number of optimizer steps to run"
            )
        if 0 < max_steps <= self.phases.sft_warmup_steps:
            rank_zero_warn(
                f"model.phases.sft_warmup_steps ({self.phases.sft_warmup_steps}) >= trainer.max_steps ({max_steps}): "
                "this run is SFT only, no RL step will run"
            )

    def configure_model(self) -> None:
        if self.policy is None:
            if self.model_config.name_or_path:
                policy, tokenizer = load_pretrained(self.model_config)
            else:
                tokenizer = build_tokenizer(self.datamodule.tokenizer_corpus(), self.model_config.tiny.vocab_size)
                apply_chat_template_setting(tokenizer, self.model_config)
                policy = build_tiny_model(self.model_config.tiny, tokenizer, seed=0)
            self._install(policy, tokenizer)
        self.datamodule.connect(self.engine, self.tokenizer)

    def _install(self, policy: torch.nn.Module, tokenizer) -> None:
        if self.model_config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if self.algorithm.kl_coef > 0 and self.model_config.lora_rank <= 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self.policy = apply_lora(policy, self.model_config)
        self.tokenizer = tokenizer
        self.engine = build_engine(self.engine_config, self.policy, tokenizer)

    def use_engine(self, engine: RolloutEngine) -> None:
        """Roll out with ``engine`` from now on (tests swap in scripted engines this way)."""
        self.engine = engine
        self.datamodule.connect(engine, self.tokenizer)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        cfg = self.optim_config
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))

    def learning_rate(self) -> float:
        max_steps = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        return scheduled_learning_rate(self.global_step, self.optim_config, self.phases.sft_warmup_steps, max_steps)

    @property
    def phase(self) -> str:
        return "sft" if self.global_step < self.phases.sft_warmup_steps else "rl"

    # ---- the training step ----------------------------------------------------------------------
    def training_step(self, batch: TaskBatch, batch_idx: int) -> None:
        dm = self.datamodule
        if not getattr(self.engine, "needs_weight_sync", False):  # a synced engine's version is its sync count
            self.engine.weight_version = self.global_step
        phase, step = self.phase, self.global_step
        timings: dict[str, float] = {}
        start = time.perf_counter()
        exploration = dm.rollout(batch, phase)
        timings["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        experience, trajectories = make_experience(
            exploration,
            self.algorithm,
            dm.max_reward,
            self.tokenizer.pad_token_id,
            dm.scoring_temperature,
            adjust_advantages=self.ranking_adjustment() if phase == "rl" else None,
            replay_behaviour=dm.replay.behaviour,
        )
        timings["reward"] = time.perf_counter() - start
        self.last_trajectories, self.last_experience = trajectories, experience
        start = time.perf_counter()
        stats = self.optimize(experience)
        timings["train"] = time.perf_counter() - start
        self.last_step_metrics = self.step_metrics(phase, exploration, experience, stats, timings)
        self.log_step_metrics(self.last_step_metrics, step)

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
        self, phase: str, exploration, experience: ExperienceBatch, stats: dict[str, float], timings: dict[str, float]
    ) -> dict[str, float]:
        """Everything a step logs: timings and throughput, the exploration's figures (RL steps), the
        optimizer's statistics, the batch's token counts and the components' activity (docs/monitoring.md)."""
        metrics = {"time/rollout_s": timings["rollout"], **exploration.metrics}
        if phase == "rl":
            metrics["time/reward_s"] = timings["reward"]
            metrics.update(trajectory_metrics(exploration.groups))
            generated = sum(t.num_response_tokens for t in exploration.trajectories)
            metrics["perf/rollout_tokens_per_s"] = generated / max(timings["rollout"], 1e-9)
            if hasattr(self.engine, "metrics"):
                metrics.update(self.engine.metrics())
            if self.algorithm.ranking.enabled:
                metrics.update(self.last_ranking.metrics())
            metrics.update(objective_activity(experience, self.algorithm, self.datamodule.max_reward))
        metrics.update(stats)
        metrics["time/train_s"] = timings["train"]
        metrics["perf/train_tokens_per_s"] = float(experience.attention_mask.sum()) / max(timings["train"], 1e-9)
        metrics.update(experience_metrics(experience))
        metrics["train/phase_rl"] = float(phase == "rl")
        return {k: float(v) for k, v in metrics.items()}

    # ---- R³'s ranking of failures (the experience path's advantage hook) ------------------------
    def ranking_adjustment(self):
        """The ``AdvantageAdjustment`` hook of this step: R³'s structural-entropy ranking bonus of failed
        samples when ``algorithm.ranking.enabled``, else None. Entropies come from the trainer's own
        forward pass (at the sampling temperature), so they do not depend on the engine."""
        cfg = self.algorithm.ranking
        if not cfg.enabled:
            return None

        def adjust(groups: list[Group], advantages: torch.Tensor) -> torch.Tensor:
            rl = [t for g in groups for t in g.trajectories]
            batch = collate_experience(rl, [0.0] * len(rl), self.tokenizer.pad_token_id, pivotal_credit=False)
            batch.temperature = self.datamodule.scoring_temperature
            entropy = self.response_entropy(batch)
            response = (batch.turn_index[:, 1:] >= 0).float()
            adjusted, self.last_ranking = rank_failures(groups, advantages, entropy, response, cfg, self.datamodule.max_reward)
            return adjusted

        return adjust

    @torch.no_grad()
    def response_entropy(self, batch: ExperienceBatch) -> torch.Tensor:
        """Per-token entropy [B, T-1] of the policy at the batch's temperature, in micro-batches, at the
        predictions of response tokens (and any other position after the first one; the leading
        predictions no response token follows are 0: ``window_logits`` skips them and encodes a group's
        shared prompt once)."""
        entropy = torch.zeros(batch.input_ids.shape[0], max(batch.input_ids.shape[1] - 1, 0))
        for rows in batch.micro_batches(self.optim_config.micro_batch_size):
            micro = batch.take(rows).to(self.device)
            if micro.input_ids.shape[1] < 2:
                continue
            start = scored_window_start(micro.turn_index >= 0, micro.attention_mask)
            logits = self.window_logits(self.policy, micro.input_ids, micro.attention_mask, start)
            values = algos.entropy_from_logits(tempered(logits, micro.temperature)).float().cpu()
            entropy[rows, start : start + values.shape[1]] = values
        return entropy

    # ---- optimization -------------------------------------------------------------------------
    def _reduce_sum(self, value: float) -> float:
        tensor = torch.tensor(float(value), device=self.device)
        if self.trainer.world_size > 1:
            tensor = self.trainer.strategy.reduce(tensor, reduce_op="sum")
        return float(tensor.item())

    def sequence_logprobs(
        self, model: torch.nn.Module, batch: ExperienceBatch, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [b, T-1-start] of tokens start+1.. at the batch's sampling temperature, the model's own
        logits [b, T-1-start, V]); the first ``start`` predictions are not computed (``window_logits``)."""
        logits = self.window_logits(model, batch.input_ids, batch.attention_mask, start)
        return algos.selective_log_softmax(tempered(logits, batch.temperature), batch.input_ids[:, 1 + start :]), logits

    def window_logits(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Logits [b, T-1-start, V] of predictions start..T-2 (of tokens start+1..T-1) for right-padded rows
        [b, T] whose first ``start`` tokens are real (``scored_window_start``).

        Logits are computed only where a loss reads them. Rows that share their first ``start`` tokens (a
        GRPO group's prompt) have them encoded once: a forward over the distinct prefixes keeps their keys
        and values, every row reads its prefix's as its cache, and a second forward runs the rest of the
        rows. Gradients flow back through the cache into the prefix's forward, so this is the full forward's
        computation, batched differently (equal up to float rounding: tests/module/test_window_logits.py).
        """
        rows, width = input_ids.shape
        self.forward_tokens["in_rows"] += rows * width
        if start > 0:
            prefixes, row_of = torch.unique(input_ids[:, :start], dim=0, return_inverse=True)
            if len(prefixes) < rows:
                cache = self._empty_shareable_cache(model)
                if cache is not None:
                    model(input_ids=prefixes, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys[row_of], layer.values[row_of]
                    self.forward_tokens["forwarded"] += len(prefixes) * start + rows * (width - start)
                    keep = torch.arange(width - 1 - start, device=input_ids.device)
                    return model(
                        input_ids=input_ids[:, start:], attention_mask=attention_mask, past_key_values=cache,
                        use_cache=True, logits_to_keep=keep,
                    ).logits
                self.prefix_sharing_off += 1
        self.forward_tokens["forwarded"] += rows * width
        keep = torch.arange(start, width - 1, device=input_ids.device)
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits

    def _empty_shareable_cache(self, model: torch.nn.Module) -> Optional[DynamicCache]:
        """An empty cache of ``model`` through which a prefix's keys and values can be handed to rows (a
        plain per-layer cache), or None: not with gradient checkpointing (a recomputed layer would append
        to the cache twice), not under FSDP (two forwards of each unit before one backward), not for
        sliding-window or linear-attention layers."""
        if getattr(model, "is_gradient_checkpointing", False):
            return None
        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            return None
        try:
            cache = DynamicCache(config=model.config)
        except Exception:  # noqa: BLE001 - an unusual config: recompute the prefix per row
            return None
        plain = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
        return cache if plain else None

    @staticmethod
    def window_start(batch: ExperienceBatch) -> int:
        """Leading predictions of ``batch`` that no loss reads (RL or SFT tokens)."""
        return scored_window_start((batch.loss_mask > 0) | (batch.sft_mask > 0), batch.attention_mask)

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
            start = self.window_start(micro)  # unscored columns keep what they hold
            if cfg.recompute_old_logprobs:
                logp, _ = self.sequence_logprobs(self.policy, micro, start)
                # Replayed rows keep the log-probs of the policy that sampled them: their ratio is the point.
                sampled = torch.tensor([b == "sampled" for b in micro.behaviour_of_rows()]).unsqueeze(1)
                kept = experience.old_logprobs[rows, 1 + start : cols]
                experience.old_logprobs[rows, 1 + start : cols] = torch.where(sampled, logp.float().cpu(), kept)
            if need_ref:
                ref_model = self.reference if self.reference is not None else self.policy
                context = self.policy.disable_adapter() if self.reference is None else contextlib.nullcontext()
                with context:
                    logp, _ = self.sequence_logprobs(ref_model, micro, start)
                ref[rows, 1 + start : cols] = logp.float().cpu()
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
        self.forward_tokens = {"forwarded": 0, "in_rows": 0}
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
        stats["perf/train_forward_token_frac"] = self.forward_tokens["forwarded"] / max(self.forward_tokens["in_rows"], 1)
        stats["perf/train_prefix_sharing_off"] = float(self.prefix_sharing_off)
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

    # ---- a frozen teacher (ReflectRL's reflective-to-direct distillation) -----------------------
    @property
    def teacher(self) -> Optional[torch.nn.Module]:
        """A frozen copy of an earlier policy whose KL the RL loss also pays; not a submodule, so it
        stays out of the module's state dict (the callback that sets it saves it)."""
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

    def teacher_logits(self, micro: ExperienceBatch, logits: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """(The teacher's logits [b, T-1-start, V] aligned with the policy's ``logits``, rows scored under a
        context of ``teacher_contexts``). Where the teacher has no prediction of the same token (prompt
        positions) it gets the policy's own logits: no KL there."""
        if self.teacher_contexts is None:
            return self.window_logits(self.teacher, micro.input_ids, micro.attention_mask, start), 0
        prompt_len = prompt_lengths(micro.turn_index, micro.attention_mask)
        prompts = [self.teacher_contexts.get(tuple(micro.input_ids[i, : int(n)].tolist())) for i, n in enumerate(prompt_len)]
        ids, mask, offset = splice_prompts(micro.input_ids, micro.attention_mask, prompt_len, prompts, self.tokenizer.pad_token_id)
        teacher_start = max(0, int((prompt_len + offset).min()) - 1)
        window = self.window_logits(self.teacher, ids, mask, teacher_start)
        index, valid = aligned_predictions(prompt_len, offset, start, micro.input_ids.shape[1], teacher_start, ids.shape[1])
        gathered = window.gather(1, index.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
        return torch.where(valid.unsqueeze(-1), gathered, logits.detach()), sum(p is not None for p in prompts)

    def teacher_kl(self, micro: ExperienceBatch, logp: torch.Tensor, logits: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, int]:
        """(Per-token KL(π_θ ‖ π_teacher) [b, T-1-start] at the batch's sampling temperature, rows the
        teacher scored under a context of its own); ``logp``, ``logits``: the policy's from
        ``sequence_logprobs(..., start)``."""
        with torch.no_grad():
            teacher_logits, in_context = self.teacher_logits(micro, logits, start)
        student, teacher = tempered(logits, micro.temperature), tempered(teacher_logits, micro.temperature)
        if self.teacher_kl_estimator == "exact":
            return algos.full_kl(student, teacher), in_context
        teacher_logp = algos.selective_log_softmax(teacher, micro.input_ids[:, 1 + start :])
        return algos.kl_estimate(logp, teacher_logp, "k3"), in_context

    def micro_batch_loss(self, micro: ExperienceBatch, totals: dict[str, float]) -> dict[str, torch.Tensor]:
        """Loss terms of one micro-batch, each already divided by the global counts."""
        cfg = self.algorithm
        if micro.input_ids.shape[1] < 2:
            # Nothing to predict (every episode here ended before its first token: prompts longer than the
            # context). A zero loss through an ordinary forward keeps DDP/FSDP gradient reduction in step.
            dummy = torch.full((1, 2), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
            return {"loss": self.policy(input_ids=dummy, attention_mask=torch.ones_like(dummy)).logits.sum() * 0.0}
        # Predictions before ``start`` carry no loss (prompts): not computed, every per-token tensor below
        # starts there.
        start = self.window_start(micro)
        logp, logits = self.sequence_logprobs(self.policy, micro, start)
        mask = micro.loss_mask[:, 1 + start :]
        sft_mask = micro.sft_mask[:, 1 + start :]
        advantages = micro.advantages[:, 1 + start :]
        out: dict[str, torch.Tensor] = {}
        zero = logp.sum() * 0.0
        if totals["rl_tokens"] > 0:
            off_policy = torch.tensor([o == "off_policy" for o in micro.origins], device=logp.device).unsqueeze(1)
            pinned = torch.tensor([b == "pinned" for b in micro.behaviour_of_rows()], device=logp.device).unsqueeze(1)
            # Pinned rows have no usable behaviour log-probs: an off-policy refinement was sampled in another
            # context (with its critique; its rows take the shaping loss below), a replayed sample treated as
            # on-policy is scored as if drawn now. Their ratio is 1; an inf there would still turn gradients to NaN.
            old_logprobs = torch.where(pinned, logp.detach(), micro.old_logprobs[:, 1 + start :])
            result = algos.policy_loss(
                logp, old_logprobs, advantages, mask, cfg.policy_loss, cfg.clip_eps_low, cfg.clip_eps_high
            )
            per_token = result.per_token
            if off_policy.any():
                shaped = algos.shaped_off_policy_loss(logp, advantages, cfg.off_policy_gamma)
                per_token = torch.where(off_policy, shaped, per_token)
            out["loss_rl"] = algos.aggregate(per_token, mask, cfg.aggregation, totals["rl_tokens"], totals["rl_seqs"])
            if result.ratio is not None:
                m = mask.bool() & ~pinned
                out["ratio_sum"] = (result.ratio * m).sum().detach()
                out["ratio_max"] = (result.ratio * m).max().detach() if m.any() else zero.detach()
                out["clip_count"] = (result.clipped & m).sum().detach().float()
                out["ratio_count"] = m.sum().detach().float()
            with torch.no_grad():
                # log pi_theta - log pi_behaviour per origin: ~0 for fresh samples (engine and trainer agree),
                # the context-distillation gap for distilled rows (sampled with guidance, scored without).
                logratio = logp - micro.old_logprobs[:, 1 + start :]
                scored = mask.bool() & torch.isfinite(logratio)
                logratio = torch.where(scored, logratio, 0.0)
                for origin in sorted(set(micro.origins)):
                    rows = torch.tensor([o == origin for o in micro.origins], device=logp.device)
                    count = scored[rows].sum()
                    if count > 0:
                        out[f"logratio_sum/{origin}"] = logratio[rows].sum()
                        out[f"logratio_count/{origin}"] = count.float()
            if cfg.kl_coef > 0 and micro.ref_logprobs is not None:
                kl = algos.kl_estimate(logp, micro.ref_logprobs[:, 1 + start :], cfg.kl_estimator)
                out["loss_kl"] = cfg.kl_coef * algos.aggregate(kl, mask, "token_mean", totals["rl_tokens"], totals["rl_seqs"])
                out["kl_ref_sum"] = (kl.detach() * mask).sum()
            if self.teacher is not None and self.teacher_kl_coef > 0:
                teacher_kl, in_context = self.teacher_kl(micro, logp, logits, start)
                out["teacher_context_rows"] = zero.detach() + in_context
                out["teacher_rows"] = zero.detach() + len(micro)
                out["loss_teacher_kl"] = self.teacher_kl_coef * algos.aggregate(
                    teacher_kl, mask, "token_mean", totals["rl_tokens"], totals["rl_seqs"]
                )
                out["kl_teacher_sum"] = (teacher_kl.detach() * mask).sum()
        if totals["sft_tokens"] > 0:
            weight = cfg.sft_weight if self.phase == "rl" else 1.0
            # The SFT head fits the model's own distribution, not the tempered sampling one; taken from the
            # untempered logits, the warm-start is bit-for-bit the same whatever the sampling temperature.
            sft_logp = logp
            if micro.temperature != 1.0:
                sft_logp = algos.selective_log_softmax(logits, micro.input_ids[:, 1 + start :])
            nll = algos.aggregate(
                algos.sft_nll(sft_logp), sft_mask, cfg.sft_aggregation, totals["sft_tokens"], totals["sft_seqs"]
            )
            out["loss_sft"] = weight * nll
        if self.log_entropy:
            with torch.no_grad():
                ent = algos.entropy_from_logits(tempered(logits, micro.temperature))
                scored = torch.maximum(mask, sft_mask)
                out["entropy_sum"] = (ent * scored).sum()
                out["entropy_count"] = scored.sum()
        out["loss"] = sum((out[k] for k in ("loss_rl", "loss_kl", "loss_sft", "loss_teacher_kl") if k in out), zero)
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
        if "kl_teacher_sum" in sums:
            stats["distill/kl_teacher"] = sums["kl_teacher_sum"] / max(rl_tokens, 1.0)
            stats["train/loss_teacher_kl"] = sums["loss_teacher_kl"]
            stats["distill/teacher_context_rate"] = sums["teacher_context_rows"] / max(sums["teacher_rows"], 1.0)
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
        """Whether this is a periodic validation of ``fit`` that falls in the warm-start while
        ``phases.validate_during_sft`` is off (``r3l validate`` always validates)."""
        fitting = self._trainer is None or self.trainer.state.fn == "fit"
        return fitting and not self.phases.validate_during_sft and self.global_step < self.phases.sft_warmup_steps

    def validation_step(self, batch: TaskBatch, batch_idx: int) -> None:
        """Greedy and ``data.val_samples`` sampled episodes per task; the figures of
        ``data.evaluation.validation_figures``, weighted by the batch's tasks."""
        if self.skips_validation:
            return
        dm = self.datamodule
        greedy = dm.evaluate(batch.tasks, greedy=True)
        sampled = dm.evaluate(batch.tasks, greedy=False, samples=dm.val_samples)
        for name, value in validation_figures(greedy, sampled, dm.val_samples).items():
            self.val_metrics[name].update(value, weight=len(batch.tasks))

    def on_validation_epoch_end(self) -> None:
        if self.skips_validation:
            return
        for name, metric in self.val_metrics.items():
            self.log(f"val/{name}", metric.compute(), prog_bar=name == "success_rate_greedy")
            metric.reset()

    # ---- checkpoints --------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["r3lightning"] = r3lightning_section(
            self.phase,
            self.engine.weight_version if self.engine else 0,
            self.skipped_steps,
            self.tokenizer,
            self.model_config,
            in_memory_tokenizer=not self.model_config.name_or_path,
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this before it restores anything: the whole restorable state is checked here.
        check_checkpoint_state(checkpoint, getattr(self._trainer, "ckpt_path", None), self._trainer)
        saved = check_loadable(checkpoint, self.state_dict(), self.tokenizer, self.phases.sft_warmup_steps)
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        if self.engine is not None:
            self.engine.weight_version = int(saved.get("weight_version", 0))


# ``R3LightningModule.load_from_checkpoint`` loads before any instance exists: allow the default configs' types.
allow_in_checkpoints(*(p.default for p in inspect.signature(R3LightningModule.__init__).parameters.values()))
