"""A callback for the two-process ``r3l fit`` of test_ddp.py: each rank writes ``OUT_DIR/rank{r}.json``
with the task ids it trained on per step (and those of its documented shard), its local and all-reduced token counts, the monitor's
cross-rank figures and a hash of its parameters before and after training. Named by class path in
the run's config (tests/module on its PYTHONPATH)."""

import hashlib
import json
from pathlib import Path

import lightning as L


def param_hash(module) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(module.policy.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class DDPRecord(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.steps: list[dict] = []
        self.reductions: list[tuple[float, float]] = []
        self.initial_hash = None

    def on_train_start(self, trainer, module):
        self.initial_hash = param_hash(module)
        original = module._reduce_sum

        def reduce_sum(value):
            reduced = original(value)
            self.reductions.append((float(value), reduced))
            return reduced

        module._reduce_sum = reduce_sum

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        first = (batch.step * trainer.world_size + trainer.global_rank) * len(batch.tasks)
        shard = list(range(first, first + len(batch.tasks)))
        self.steps.append({
            "step": batch.step,
            "task_ids": [t.task_id for t in batch.tasks],
            # The rank's shard as the stream documents it: indices (step * W + rank) * n ... + n - 1.
            "shard": shard,
            "shard_task_ids": [trainer.datamodule.suite.train_task(i).task_id for i in shard],
            "rl_tokens": float(outputs["experience"].loss_mask[:, 1:].sum()),
            "micro_batches": len(outputs["experience"].micro_batches(module.optim_config.micro_batch_size)),
            "rl_tokens_all_ranks": float(metrics["train/rl_tokens_all_ranks"]),
            "reductions": self.reductions,
            "reward_mean": float(metrics["reward/mean"]) if "reward/mean" in metrics else None,
            "reward_mean_all_ranks": float(metrics["reward/mean_all_ranks"]) if "reward/mean_all_ranks" in metrics else None,
        })
        self.reductions = []

    def on_train_end(self, trainer, module):
        result = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "initial_hash": self.initial_hash,
            "final_hash": param_hash(module),
            "steps": self.steps,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
