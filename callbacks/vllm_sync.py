"""Stream the policy's weights into the colocated vLLM engine after optimizer steps, and check them.

Used with ``engine.backend: vllm`` (``configs/engine/vllm.yaml`` adds it). Only r3lightning's
public API is used: ``pl_module.policy``, ``pl_module.engine``, ``pl_module.tokenizer`` and the
weight helpers of ``r3lightning.engines.vllm.engine``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.vllm.weights import iter_policy_weights, iter_weight_buckets

DEFAULT_PROBE_PROMPTS = (
    "What is 17 + 25?",
    "Name three colours.",
    "You are in a kitchen. There is a fridge and a table. What do you do?",
    "Write the next number: 2, 4, 8, 16,",
)


class LogprobMismatchError(RuntimeError):
    """vLLM and the trainer assign different log-probs to the same tokens after a sync."""


class VLLMWeightSync(L.Callback):
    """Keeps the vLLM engine's weights equal to the trainer's.

    At train start (after any checkpoint restore) and after every ``every_n_steps``-th optimizer
    step, the policy's full weights are streamed into the engine in buckets of at most ``bucket_mb``
    MiB: plain parameters as they are, LoRA adapters merged into their base weights (computed as new
    tensors; the trained model is untouched), tied embeddings also sent as the LM head. Under DDP
    every rank syncs its own engine from its own replica. Under FSDP (v1) the parameters are
    gathered one FSDP unit at a time (``summon_full_params(unit, recurse=False, writeback=False)``)
    on every rank; FSDP2 / DTensor parameters one parameter at a time (``full_tensor()``). The
    engine's prefix cache is reset and ``weight_version`` incremented after each post-step sync.

    Every ``check_every_n`` syncs (and after the first one) vLLM greedily completes a fixed probe
    batch; the trainer re-scores those tokens, and the largest absolute log-prob difference is
    logged as ``sync/logprob_max_abs_diff``. Above ``max_logprob_diff`` (on any rank) training stops
    with :class:`LogprobMismatchError`: the engine is sampling from weights other than the ones
    being trained.

    On GPU with ``engine.sleep_mode``, the engine is put to sleep before the first backward pass of
    each step and woken for the sync and the next rollout.

    Args:
        every_n_steps: sync after every n-th optimizer step (1: rollouts are always on-policy).
        bucket_mb: most MiB of weights materialized (gathered, merged, moved) at once.
        check_every_n: compare log-probs every n syncs (0: only after the first sync).
        max_logprob_diff: largest tolerated absolute log-prob difference; about 1e-4 in float32,
            0.1-0.5 with bfloat16 engines.
        probe_prompts: user messages of the probe batch (rendered with the tokenizer's chat template).
        probe_tokens: tokens vLLM generates per probe prompt.
        offload_to_cpu: FSDP: gather each unit into CPU memory (less GPU memory, slower).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        bucket_mb: int = 512,
        check_every_n: int = 10,
        max_logprob_diff: float = 0.5,
        probe_prompts: Optional[list[str]] = None,
        probe_tokens: int = 16,
        offload_to_cpu: bool = False,
    ) -> None:
        if every_n_steps < 1 or bucket_mb < 1 or check_every_n < 0 or probe_tokens < 1:
            raise ValueError("VLLMWeightSync: every_n_steps, bucket_mb and probe_tokens must be >= 1, check_every_n >= 0")
        self.every_n_steps = every_n_steps
        self.bucket_mb = bucket_mb
        self.check_every_n = check_every_n
        self.max_logprob_diff = max_logprob_diff
        self.probe_prompts = list(probe_prompts) if probe_prompts else list(DEFAULT_PROBE_PROMPTS)
        self.probe_tokens = probe_tokens
        self.offload_to_cpu = offload_to_cpu
        self.num_syncs = 0
        self.synced_step: Optional[int] = None
        self.last_sync_s: Optional[float] = None
        self.last_sync_bytes = 0
        self.last_diff: Optional[float] = None
        self._active = True
        self._pending: dict[str, float] = {}

    # ---- hooks ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(pl_module, "engine", None)
        if engine is None or not hasattr(engine, "load_weights"):
            self._active = False
            rank_zero_warn(
                f"VLLMWeightSync: the engine ({type(engine).__name__}) takes no weight sync; the callback does "
                "nothing (it is meant for engine.backend=vllm)"
            )
            return
        self._active = True
        # The engine was started from the weights at configure time; a restored checkpoint (or a
        # model_path other than the policy) may differ, so start from the trainer's weights.
        self.sync(trainer, pl_module, bump_version=False)
        self.check(trainer, pl_module)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._active:
            sleep = getattr(pl_module.engine, "sleep", None)
            if sleep is not None:
                sleep()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        step = trainer.global_step
        if step != self.synced_step and step % self.every_n_steps == 0:
            self.sync(trainer, pl_module, bump_version=True)
            if self.check_every_n and self.num_syncs % self.check_every_n == 0:
                self.check(trainer, pl_module)
        self._pending["sync/weight_version"] = float(pl_module.engine.weight_version)
        for name, value in self._pending.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        self._pending = {}

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # With every_n_steps > 1 the engine may lag the trainer; validate the current weights.
        if self._active and self.synced_step is not None and trainer.global_step != self.synced_step:
            self.sync(trainer, pl_module, bump_version=True)

    # ---- the work ------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, trainer: L.Trainer, pl_module: L.LightningModule, bump_version: bool = True) -> float:
        """Stream the policy's weights into the engine; returns the seconds it took."""
        engine = pl_module.engine
        start = time.perf_counter()
        weights = iter_policy_weights(
            pl_module.policy, fsdp_root=trainer.strategy.model, offload_to_cpu=self.offload_to_cpu
        )
        buckets = iter_weight_buckets(weights, self.bucket_mb << 20, device=getattr(engine, "device", None))
        self.last_sync_bytes = engine.load_weights(item for bucket in buckets for item in bucket)
        self.last_sync_s = time.perf_counter() - start
        self.synced_step = trainer.global_step
        if bump_version:
            self.num_syncs += 1
            pl_module.stamp_weight_version(engine.weight_version + 1)
        self._pending["time/sync_s"] = self.last_sync_s
        return self.last_sync_s

    def probe_batch(self, tokenizer) -> list[list[int]]:
        """Token ids of the probe prompts, rendered with the chat template when there is one."""
        prompts = []
        for text in self.probe_prompts:
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
            prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        return prompts

    @torch.no_grad()
    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """Largest |vLLM - trainer| log-prob over the probe batch's greedy completions (max over ranks);
        raises LogprobMismatchError above ``max_logprob_diff``."""
        prompts = self.probe_batch(pl_module.tokenizer)
        generations = pl_module.engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=self.probe_tokens))
        with fsdp_root_unsharded(trainer.strategy.model):
            trainer_lp = trainer_logprobs(
                pl_module.policy, prompts, [g.token_ids for g in generations], pl_module.tokenizer.pad_token_id, pl_module.device
            )
        diff = 0.0
        for gen, ref in zip(generations, trainer_lp):
            if gen.token_ids:
                diff = max(diff, float((torch.tensor(gen.logprobs) - ref).abs().max()))
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            value = torch.tensor(diff, device=pl_module.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            diff = float(value)
        self.last_diff = diff
        self._pending["sync/logprob_max_abs_diff"] = diff
        if not diff <= self.max_logprob_diff:
            raise LogprobMismatchError(
                f"VLLMWeightSync: vLLM and trainer log-probs differ by {diff:.4g} on the probe batch "
                f"(> max_logprob_diff={self.max_logprob_diff}) at step {trainer.global_step}, engine weight_version "
                f"{pl_module.engine.weight_version}. The engine is not sampling from the weights being trained "
                "(a sync was skipped, or weights were loaded under the wrong names); raise max_logprob_diff only "
                "if this is numerical noise of a lower-precision engine dtype."
            )
        return diff


def fsdp_root_unsharded(root: torch.nn.Module):
    """Context for calling the policy directly (not through the wrapped LightningModule) under FSDP1:
    the parameters the root unit owns (those outside the policy's own units, e.g. embeddings) are
    gathered for the duration; nested units gather their own in their forward as usual. A no-op
    without FSDP."""
    import contextlib

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not isinstance(root, FSDP):
        return contextlib.nullcontext()
    return FSDP.summon_full_params(root, recurse=False, writeback=False)


def trainer_logprobs(
    policy: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_id: int, device
) -> list[torch.Tensor]:
    """Log-probs (temperature 1, float32, CPU) the policy gives each completion after its prompt."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1  # right padding: positions of real tokens are unchanged
    was_training = policy.training
    policy.eval()
    try:
        logits = policy(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
    finally:
        policy.train(was_training)
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for row, (p, c) in enumerate(zip(prompts, completions)):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        out.append(logp[row, positions, torch.tensor(c, dtype=torch.long)] if c else torch.zeros(0))
    return out
