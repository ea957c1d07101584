"""Two-process DDP training on CPU (gloo); run as a script by test_ddp.py: ``python ddp_train.py OUT_DIR``.

Lightning's DDP launcher re-runs this script for rank 1. Each rank writes ``OUT_DIR/rank{r}.json``:
the task ids it trained on, its local and all-reduced token counts, the monitor's cross-rank token
count and a hash of its parameters after training.
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from digit_suite import DigitSuite  # noqa: E402
from harness import module_and_data, quiet_trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from r3lightning.callbacks.health import HealthWatchdog  # noqa: E402
from r3lightning.callbacks.monitor import TrainingDynamicsMonitor  # noqa: E402
from r3lightning.envs.base import Task  # noqa: E402
from r3lightning.algos.objective import AlgorithmConfig  # noqa: E402

STEPS = 3


class CountingSuite(DigitSuite):
    """Digit rewards (a random policy gets mixed rewards); demonstrations of task-dependent length, so
    the two ranks have different local token counts."""

    def train_task(self, index):
        return Task(f"digit#{index}", f"Count to {index % 5 + 1}.", answer=" ".join(str(i) for i in range(1, index % 5 + 2)))


def param_hash(module) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(module.policy.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Record(L.Callback):
    def __init__(self):
        self.steps = []
        self.reductions = []
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
        self.steps.append(
            {
                "step": batch.step,
                "task_ids": [t.task_id for t in batch.tasks],
                "rl_tokens": float(module.last_experience.loss_mask[:, 1:].sum()),
                "rl_tokens_all_ranks": float(metrics["train/rl_tokens_all_ranks"]),
                "reductions": self.reductions,
                "reward_mean": float(metrics["reward/mean"]) if "reward/mean" in metrics else None,
                "reward_mean_all_ranks": float(metrics["reward/mean_all_ranks"]) if "reward/mean_all_ranks" in metrics else None,
            }
        )
        self.reductions = []


def main(out_dir: str) -> None:
    module, dm = module_and_data(
        CountingSuite(), algorithm=AlgorithmConfig(policy_loss="ppo_clip"), micro_batch_size=3, sft_steps=1
    )
    record = Record()
    trainer = quiet_trainer(
        STEPS, strategy=DDPStrategy(process_group_backend="gloo"), accelerator="cpu", devices=2,
        callbacks=[TrainingDynamicsMonitor(), HealthWatchdog(), record],  # record reads what the others logged
    )
    trainer.fit(module, dm)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "initial_hash": record.initial_hash,
        "final_hash": param_hash(module),
        "steps": record.steps,
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
