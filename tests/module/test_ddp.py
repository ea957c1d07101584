"""Two-process DDP on CPU (gloo): sharded tasks, all-reduced token counts, identical replicas."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ddp_train.py")


def test_two_process_ddp_shards_tasks_and_keeps_replicas_identical(tmp_path):
    # A script in a fresh interpreter: Lightning's DDP launcher re-runs it for rank 1, and the test
    # process itself is never forked.
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]  # tests/ for the digit suite and the harness
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    steps = ranks[0]["steps"]
    assert len(steps) == len(ranks[1]["steps"]) == 3 and all(r["global_step"] == 3 for r in ranks)

    # Tasks are sharded: no task is seen by both ranks, at any step.
    seen = [{t for s in r["steps"] for t in s["task_ids"]} for r in ranks]
    assert seen[0] and seen[1] and not seen[0] & seen[1]

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
            assert s0["reward_mean_all_ranks"] == s1["reward_mean_all_ranks"] == expected

    # The check above means something: the ranks' local counts differ (their tasks do).
    assert any(a[0] != b[0] for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]) for a, b in zip(s0["reductions"], s1["reductions"]))

    # Replicas start equal, train, and stay bit-identical.
    assert ranks[0]["initial_hash"] == ranks[1]["initial_hash"]
    assert ranks[0]["final_hash"] == ranks[1]["final_hash"] != ranks[0]["initial_hash"]


def test_cli_ddp_recipe_with_default_callbacks_and_one_micro_batch(tmp_path):
    """`r3l fit` with configs/trainer/ddp.yaml: the default callbacks (sample logger, phase report)
    must not make rank-0-only collective calls, and a single micro-batch per step must work."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable, "-m", "r3lightning.cli", "fit",
            "--config", str(ROOT / "configs/examples/grpo_arithmetic_cpu.yaml"),
            "--config", str(ROOT / "configs/trainer/cpu.yaml"),
            "--config", str(ROOT / "configs/trainer/ddp.yaml"),
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
            "--model.phases.sft_warmup_steps", "1", "--model.optim.micro_batch_size", "512",
            "--data.suite.init_args.num_val_tasks", "8", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "after RL" in done.stdout
    assert list(tmp_path.rglob("rollout_samples.jsonl"))
    # The validation report counts the tasks of both ranks (4 each).
    [report] = [json.loads(p.read_text()) for p in tmp_path.rglob("validation_step3.json")]
    assert (report["tasks"], report["samples_per_task"]) == (8, 1)
