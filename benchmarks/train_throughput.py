"""Training throughput of R3LightningModule's update next to a plain PyTorch loop on the same batch.

``ours``: ``R3LightningModule.optimize(experience)`` called from ``training_step`` of a real
Lightning ``Trainer.fit`` (manual optimization: ``manual_backward`` through the strategy and
precision plugin, ``LightningOptimizer.step``), on a fixed ExperienceBatch (rollouts are not part of
this benchmark: the subclass below only replaces ``training_step``'s rollout with that batch).

``plain``: the same objective written the way one would in a bare PyTorch script: forward, log-probs
with ``cross_entropy``, PPO-clip surrogate, token-mean over the batch's loss tokens, backward per
micro-batch, global-norm clipping, ``AdamW.step()``. Same architecture and initial weights, same
tokens, same micro-batches (``ExperienceBatch.micro_batches``: rows ordered longest first, each
micro-batch trimmed to its longest row), same optimizer settings.

Both run inside the same training steps, in alternating order, so machine noise hits both alike.
Wall-clock figures are what the design asks for; on a shared CPU box they are noisy, so the same
ratios are also given in process CPU time (``*_cpu_time``), which other processes do not inflate.
A third variant, ``ours_no_entropy``, is ours with ``log_entropy=False`` (the per-step entropy metric
costs one extra softmax pass over the logits). Figures are medians over ``--repeats`` steps after
``--warmup`` steps.

    python -m benchmarks.train_throughput --out benchmarks/results/train_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L
import torch
import torch.nn.functional as F

from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
from r3lightning.envs.math_env import MathSuite
from r3lightning.training.models import ModelConfig, TinyModelSpec, build_tiny_model, build_tokenizer, count_parameters
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.optim import OptimConfig
from r3lightning.module import R3LightningModule
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.types import ExperienceBatch

VARIANTS = ("ours", "ours_no_entropy", "plain")


def tiny_spec(vocab_size: int, target_params: int, hidden_size: int = 256) -> TinyModelSpec:
    """A Qwen2 spec of width ``hidden_size`` (head size 32, half as many KV heads, MLP 3x wide) whose
    depth (1-32 layers) puts the parameter count closest to ``target_params``."""
    best, best_gap = None, None
    for layers in range(1, 33):
        spec = TinyModelSpec(
            hidden_size=hidden_size, num_layers=layers, num_attention_heads=hidden_size // 32,
            num_key_value_heads=hidden_size // 64, intermediate_size=3 * hidden_size, vocab_size=vocab_size,
        )
        # Qwen2 block: q,o (h*h) + k,v (h*kv_dim) + qkv biases + 3 MLP matrices + 2 norms.
        h, kv = spec.hidden_size, spec.hidden_size // spec.num_attention_heads * spec.num_key_value_heads
        block = 2 * h * h + 2 * h * kv + (h + 2 * kv) + 3 * h * spec.intermediate_size + 2 * h
        params = layers * block + vocab_size * h + h
        gap = abs(params - target_params)
        if best_gap is None or gap < best_gap:
            best, best_gap = spec, gap
    return best


def make_experience(batch: int, max_len: int, vocab: int, pad_id: int, seed: int) -> ExperienceBatch:
    """A right-padded batch shaped like GRPO rollouts: a prompt then a response of varying length,
    loss on the response tokens, one advantage per sequence (group-normalized rewards in groups of 8)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen)
    prompt = max_len // 4
    input_ids = torch.full((batch, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)
    loss_mask = torch.zeros((batch, max_len))
    for b, n in enumerate(lengths.tolist()):
        input_ids[b, :n] = torch.randint(0, vocab, (n,), generator=gen)
        attention_mask[b, :n] = 1
        loss_mask[b, prompt:n] = 1.0
    rewards = (torch.rand(batch, generator=gen) > 0.5).float()
    groups = rewards.view(-1, 8) if batch % 8 == 0 else rewards.view(1, -1)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
    turn_index = torch.where(loss_mask > 0, 0, -1).long()
    return ExperienceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        sft_mask=torch.zeros_like(loss_mask),
        turn_index=turn_index,
        advantages=adv.unsqueeze(1) * loss_mask,
        old_logprobs=torch.zeros((batch, max_len)),
        rewards=rewards,
        origins=["base"] * batch,
        task_ids=[f"task-{i // 8}" for i in range(batch)],
    )


@torch.no_grad()
def fill_behaviour_logprobs(model: torch.nn.Module, exp: ExperienceBatch, micro: int) -> None:
    """old_logprobs from the initial weights, so the PPO ratio starts at 1 as after a real rollout."""
    for rows in exp.micro_batches(micro):
        m = exp.take(rows)
        logits = model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, m.input_ids[:, 1:, None]).squeeze(-1)
        exp.old_logprobs[rows, 1 : m.input_ids.shape[1]] = logp


class PlainLoop:
    """The bare-PyTorch reference: same objective, micro-batches and optimizer as the module."""

    def __init__(self, model: torch.nn.Module, exp: ExperienceBatch, optim: OptimConfig, algo: AlgorithmConfig) -> None:
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas)
        self.grad_clip = optim.grad_clip
        self.eps_low, self.eps_high = algo.clip_eps_low, algo.clip_eps_high
        self.micro = [exp.take(rows) for rows in exp.micro_batches(optim.micro_batch_size)]
        self.total_tokens = float(exp.loss_mask[:, 1:].sum())

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for m in self.micro:
            logits = self.model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits[:, :-1]
            labels = m.input_ids[:, 1:]
            logp = -F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            mask, adv = m.loss_mask[:, 1:], m.advantages[:, 1:]
            ratio = torch.exp(logp - m.old_logprobs[:, 1:])
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv)
            loss = -(surrogate * mask).sum() / self.total_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return total


class BenchModule(R3LightningModule):
    """R3LightningModule whose training_step optimizes a fixed batch instead of rolling out, and also
    times the plain loop in the same step (alternating order)."""

    def setup_bench(self, policy, tokenizer, experience, plain: PlainLoop, warmup: int) -> "BenchModule":
        """Set after construction, so save_hyperparameters never sees the models or the batch."""
        self._bench_policy, self._bench_tokenizer = policy, tokenizer
        self.experience, self.plain, self.warmup = experience, plain, warmup
        self.times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        self.cpu_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        self.first_losses: dict[str, float] = {}
        self.steps_done = 0  # batch_idx restarts every epoch of the rollout dataloader
        return self

    def configure_model(self) -> None:
        if self.policy is None:
            self._install(self._bench_policy, self._bench_tokenizer)

    def _ours(self, log_entropy: bool) -> float:
        self.log_entropy = log_entropy
        stats = self.optimize(self.experience)
        return stats["train/loss"]

    def training_step(self, batch, batch_idx: int) -> None:
        runs = {
            "ours": lambda: self._ours(True),
            "ours_no_entropy": lambda: self._ours(False),
            "plain": self.plain.step,
        }
        step = self.steps_done
        self.steps_done += 1
        order = list(VARIANTS) if step % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = runs[name]()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if step == 0:
                self.first_losses[name] = loss
            if step >= self.warmup:
                self.times[name].append(elapsed)
                self.cpu_times[name].append(cpu_elapsed)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128, help="longest sequence (rows are max/2..max tokens)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--target-params", type=int, default=5_000_000)
    parser.add_argument("--hidden-size", type=int, default=256, help="model width; depth is set by --target-params")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default) or gpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")

    suite = MathSuite(source="arithmetic", num_val_tasks=4, instruction="")
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=args.seq_len)
    tokenizer = build_tokenizer(corpus_from_suite(suite, agent), vocab_size=1024)
    spec = tiny_spec(len(tokenizer), args.target_params, args.hidden_size)
    policy = build_tiny_model(spec, tokenizer, seed=0)
    reference_copy = copy.deepcopy(policy)
    params = count_parameters(policy)

    experience = make_experience(args.batch_size, args.seq_len, len(tokenizer), tokenizer.pad_token_id, seed=0)
    fill_behaviour_logprobs(policy, experience, args.micro_batch_size)

    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", aggregation="token_mean")
    optim = OptimConfig(lr=1e-5, micro_batch_size=args.micro_batch_size, grad_clip=1.0)
    plain = PlainLoop(reference_copy.to(device), experience.to(device), optim, algo)
    module = BenchModule(model=ModelConfig(tiny=spec), algorithm=algo, optim=optim).setup_bench(
        policy, tokenizer, experience, plain, args.warmup
    )
    datamodule = RolloutDataModule(suite, group_size=8, tasks_per_step=1, agent=agent)
    trainer = L.Trainer(
        # Each training step runs two optimizer steps of ours (with and without the entropy metric).
        accelerator=args.accelerator, devices=1, precision="32-true", max_steps=2 * (args.warmup + args.repeats),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, datamodule)

    tokens = float(experience.attention_mask.sum())
    loss_tokens = float(experience.loss_mask[:, 1:].sum())
    median = {name: statistics.median(module.times[name]) for name in VARIANTS}
    cpu_median = {name: statistics.median(module.cpu_times[name]) for name in VARIANTS}
    ours, plain_tps = tokens / median["ours"], tokens / median["plain"]
    figures = {
        "train_tokens_per_s": ours,
        "train_tokens_per_s_no_entropy": tokens / median["ours_no_entropy"],
        "plain_torch_tokens_per_s": plain_tps,
        "overhead_ratio": plain_tps / ours - 1.0,
        "overhead_ratio_no_entropy": plain_tps / (tokens / median["ours_no_entropy"]) - 1.0,
        # The same comparison in process CPU time: robust to other processes sharing the cores.
        "overhead_ratio_cpu_time": cpu_median["ours"] / cpu_median["plain"] - 1.0,
        "overhead_ratio_no_entropy_cpu_time": cpu_median["ours_no_entropy"] / cpu_median["plain"] - 1.0,
        "step_s_median_ours": median["ours"],
        "step_s_median_ours_no_entropy": median["ours_no_entropy"],
        "step_s_median_plain": median["plain"],
        "batch_sequences": float(args.batch_size),
        "batch_max_len_tokens": float(args.seq_len),
        "batch_tokens": tokens,
        "batch_loss_tokens": loss_tokens,
        "micro_batches": float(-(-args.batch_size // args.micro_batch_size)),
        "param_count": float(params),
        # Step 0 runs ours first and plain on its own untouched copy: both see the initial weights.
        "first_step_loss_abs_diff_ours_vs_plain": abs(module.first_losses["ours"] - module.first_losses["plain"]),
    }
    result = {
        "benchmark": "train_throughput",
        "figures": figures,
        "config": {
            "model": {"architecture": spec.architecture, "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                      "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
                      "intermediate_size": spec.intermediate_size, "vocab_size": len(tokenizer)},
            "algorithm": {"advantage": algo.advantage, "policy_loss": algo.policy_loss, "aggregation": algo.aggregation},
            "optim": {"lr": optim.lr, "micro_batch_size": optim.micro_batch_size, "grad_clip": optim.grad_clip},
            "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats, "warmup": args.warmup,
            "accelerator": args.accelerator, "precision": "32-true",
            "order": "ours, ours_no_entropy, plain alternated with its reverse every step",
            "raw_step_s": module.times,
            "raw_step_cpu_s": module.cpu_times,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "lightning": L.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cuda_device": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "loadavg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return result


if __name__ == "__main__":
    main()
