"""Two-process DDP on CPU (gloo) through ``r3l fit``: sharded tasks, all-reduced token counts,
identical replicas, the default callbacks, steps of one micro-batch and of several.

One run checks all of it: a DDP run costs two fresh interpreters (Lightning's launcher re-runs the
command for rank 1), most of this test's time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_r3l_fit_with_ddp_shards_tasks_reduces_counts_and_keeps_replicas_identical(tmp_path):
    # The record callback (ddp_record.py) is named by class path (tests/module is on the path of both
    # ranks), after the default callbacks whose logged figures it reads; the CLI adds the other defaults.
    extra = tmp_path / "record.yaml"
    extra.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "r3lightning.callbacks.TrainingDynamicsMonitor"},
        {"class_path": "r3lightning.callbacks.HealthWatchdog"},
        {"class_path": "ddp_record.DDPRecord", "init_args": {"out_dir": str(tmp_path)}},
    ]}}))
    path = [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run(
        [
            sys.executable, "-m", "r3lightning.cli.main", "fit",
            "--config", str(ROOT / "configs/examples/grpo_arithmetic_cpu.yaml"),
            "--config", str(ROOT / "configs/trainer/cpu.yaml"),
            "--config", str(ROOT / "configs/trainer/ddp.yaml"),
            "--config", str(extra),
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
            "--model.phases.warmstart.steps", "1", "--model.optim.micro_batch_size", "32",
            "--data.suite.init_args.num_val_tasks", "8", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    # The default callbacks (sample logger, phase report) made no rank-0-only collective call.
    assert "after RL" in done.stdout
    assert list(tmp_path.rglob("rollout_samples.jsonl"))
    # The validation report counts the tasks of both ranks (4 each).
    [report] = [json.loads(p.read_text()) for p in tmp_path.rglob("validation_step3.json")]
    assert (report["tasks"], report["samples_per_task"]) == (8, 1)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == 3 and all(r["global_step"] == 3 for r in ranks)
    # The warm-up step's 32 demonstrations per rank are one micro-batch of 32; an RL step's 128 samples
    # are several: gradients are summed over ranks once per step either way.
    assert [s["micro_batches"] for s in ranks[0]["steps"]] == [1, 4, 4]

    # Tasks are sharded: each rank trains on its own task indices (arithmetic task ids name the problem,
    # and a problem can come up at two indices, so the ids are checked against the indices' tasks).
    shards = [{i for s in r["steps"] for i in s["shard"]} for r in ranks]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    for r in ranks:
        assert all(s["task_ids"] == s["shard_task_ids"] for s in r["steps"])
    assert all(s0["task_ids"] != s1["task_ids"] for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]))

    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        # Token counts the losses are normalized by are sums over both ranks.
        # rl tokens, rl sequences, sft tokens, sft sequences
        assert len(s0["reductions"]) == len(s1["reductions"]) == 4
        for (local0, reduced0), (local1, reduced1) in zip(s0["reductions"], s1["reductions"]):
            assert reduced0 == reduced1 == local0 + local1
        # The monitor's torchmetrics count agrees on both ranks.
        assert s0["rl_tokens_all_ranks"] == s1["rl_tokens_all_ranks"] == s0["rl_tokens"] + s1["rl_tokens"]
        if s0["reward_mean"] is not None:  # RL steps: the reward over both ranks' trajectories
            expected = (s0["reward_mean"] + s1["reward_mean"]) / 2  # same number of trajectories per rank
            assert abs(s0["reward_mean_all_ranks"] - expected) < 1e-6 and s0["reward_mean_all_ranks"] == s1["reward_mean_all_ranks"]

    # The check above means something: the ranks' local counts differ (their tasks do).
    assert any(a[0] != b[0] for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]) for a, b in zip(s0["reductions"], s1["reductions"]))

    # Replicas start equal, train, and stay bit-identical.
    assert ranks[0]["initial_hash"] == ranks[1]["initial_hash"]
    assert ranks[0]["final_hash"] == ranks[1]["final_hash"] != ranks[0]["initial_hash"]
