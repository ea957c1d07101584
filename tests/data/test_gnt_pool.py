"""The golden-negative pool: verification by the suite, the GT+/GNT split, bad rows counted and named,
the figures ``r3l gnt-pool`` reports, and the command itself (from a rollouts file and from an expert)."""

import json
import time

import pytest
from harness import suite_tokenizer, tiny_loop
from reflectrl_helpers import arithmetic_suite, expert_rows, rollout_row

from r3lightning.cli.main import main
from r3lightning.data.reflectrl.gnt_pool import PoolStats, build_pool, expert_rollouts, read_rollouts, verify_rollouts, write_jsonl
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.engines.base import SamplingParams


def test_split_into_gt_plus_and_gnt_with_provenance():
    suite = arithmetic_suite()
    rows = expert_rows(suite, num_train=4)
    stats = PoolStats()
    pool, summary = build_pool(rows, suite, stats)
    assert [r["label"] for r in pool] == ["gt_plus", "gnt"] * (len(rows) // 2)
    gnt = pool[1]
    assert gnt["response"] == rows[1]["response"] and "=" in gnt["response"]  # the full reasoning is kept
    assert (gnt["reward"], gnt["success"], gnt["extracted_answer"]) == (0.0, False, str(int(gnt["answer"]) + 1))
    for key in ("task_id", "split", "index", "expert", "sampling", "sample", "source"):
        assert key in gnt
    assert summary["gnt/count"] == summary["gt_plus/count"] == len(rows) // 2
    assert summary["gnt/expert_accuracy"] == 0.5
    assert summary["gnt/count_train"] == 4 and summary["gnt/count_val"] == len(suite.val_tasks())


def test_bad_rows_are_counted_and_skipped_with_file_and_row(tmp_path):
    suite = arithmetic_suite()
    task = suite.train_task(0)
    good = rollout_row(task, "train", 0, f"\\boxed{{{task.answer}}}")
    path = tmp_path / "rollouts.jsonl"
    lines = [
        json.dumps(good),
        json.dumps({**good, "response": ""}),  # row 2: empty response
        "{not json",  # row 3
        json.dumps({k: v for k, v in good.items() if k != "answer"}),  # row 4: no reference answer
        json.dumps([1, 2]),  # row 5
        json.dumps({**good, "response": "I do not know"}),  # row 6: no parseable answer
        json.dumps({"prompt": "Compute 1+1.", "answer": "2", "response": "\\boxed{3}"}),  # row 7: minimal
    ]
    path.write_text("\n".join(lines) + "\n")
    stats = PoolStats()
    rows = read_rollouts(str(path), stats)
    pool, summary = build_pool(rows, suite, stats)
    assert [r["label"] for r in pool] == ["gt_plus", "gnt"]
    assert pool[1]["task_id"] == "rollouts.jsonl#row7" and pool[1]["source"] == f"{path}:row 7"
    assert stats.skipped == {"missing_field": 2, "invalid_json": 1, "not_an_object": 1, "unparseable_answer": 1}
    assert f"{path}, row 2: missing field 'response'" in stats.messages[0]
    assert any(f"{path}, row 4: missing field 'answer'" in m for m in stats.messages)
    assert any(f"{path}:row 6: no parseable final answer" in m for m in stats.messages)
    # The unparseable answer is the expert's failure: 1 right out of 3 answers it gave.
    assert summary["gnt/expert_accuracy"] == pytest.approx(1 / 3)
    assert summary["gnt/skipped"]["missing_field"] == 2


class SlowSuite:
    """Arithmetic whose environment never finishes verifying a response containing "hang"."""

    def __init__(self):
        self.inner = arithmetic_suite()
        self.system_prompt, self.max_turns = self.inner.system_prompt, 1

    def make_env(self):
        env = self.inner.make_env()
        step = env.step

        def slow_step(action):
            if "hang" in action:
                time.sleep(30)
            return step(action)

        env.step = slow_step
        return env


def test_a_verification_past_its_deadline_is_skipped_and_named():
    suite = arithmetic_suite()
    task = suite.train_task(0)
    rows = [rollout_row(task, "train", 0, "hang \\boxed{1}", 0), rollout_row(task, "train", 0, f"\\boxed{{{task.answer}}}", 1)]
    stats = PoolStats()
    verified = verify_rollouts(rows, SlowSuite(), stats, timeout_s=0.2)
    assert [r["sample"] for r in verified] == [1]
    assert stats.skipped == {"verifier_error": 1}
    assert "task " + task.task_id + ", sample 0: the verifier failed (EnvCallError: gnt-pool verification: SlowSuite: " in stats.messages[0]
    assert "step (task " in stats.messages[0] and "failed: CallTimeout" in stats.messages[0]


def test_expert_rollouts_keep_every_sample_and_its_provenance():
    suite = arithmetic_suite()
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=128)
    loop = tiny_loop(suite, suite_tokenizer(suite, 4, agent), agent)
    tasks = [("train", i, suite.train_task(i)) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    rows = expert_rollouts(loop, tasks, 2, params, "tiny", "hf")
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["sampling"]["max_new_tokens"] == 5 and r["expert"] == "tiny" and r["prompt"] == tasks[r["index"]][2].prompt for r in rows)
    stats = PoolStats()
    pool, summary = build_pool(rows, suite, stats)
    assert len(pool) + sum(stats.skipped.values()) == 6  # a random policy rarely boxes an answer: skipped, counted


def write_recipe(path, pool=None):
    suite = {"class_path": "r3lightning.envs.math_env.MathSuite", "init_args": {"source": "arithmetic", "num_val_tasks": 4, "instruction": ""}}
    if pool is not None:
        suite = {"class_path": "r3lightning.envs.reflective.ReflectiveSuite", "init_args": {"suite": suite, "pool": str(pool)}}
    path.write_text(json.dumps({"data": {"suite": suite, "sampling": {"max_new_tokens": 6}, "agent": {"action_format": "raw", "max_context_tokens": 128}}}))
    return str(path)


def test_gnt_pool_command_from_a_rollouts_file(tmp_path, capsys):
    suite = arithmetic_suite()
    rollouts = tmp_path / "rollouts.jsonl"
    write_jsonl(str(rollouts), expert_rows(suite, num_train=3) + [{"prompt": "x"}])
    out = tmp_path / "pool.jsonl"
    # The recipe's suite may be the ReflectiveSuite of the run the pool is for (its pool need not exist yet).
    recipe = write_recipe(tmp_path / "recipe.yaml", pool=out)
    main(["gnt-pool", "--config", recipe, "--rollouts", str(rollouts), "--out", str(out)])
    printed = capsys.readouterr()
    assert "gnt/count 7" in printed.out and "gnt/expert_accuracy 0.500" in printed.out
    assert f"{rollouts}, row 15: missing field 'answer'" in printed.err
    summary = json.loads((tmp_path / "pool.jsonl.summary.json").read_text())
    assert summary["gnt/count"] == 7 and summary["gnt/skipped"] == {"missing_field": 1}
    assert len(out.read_text().splitlines()) == 14


def test_gnt_pool_command_runs_an_expert_checkpoint(tmp_path, capsys):
    """An r3lightning checkpoint as the expert, through the hf engine; its model config saved as a plain
    dict, as ``r3l fit`` (LightningCLI) saves init arguments. The untrained expert boxes no answer: every
    row is read and skipped, and no empty pool is written."""
    import dataclasses

    import torch
    from harness import module_and_data, quiet_trainer

    module, dm = module_and_data(arithmetic_suite(), sft_steps=1)
    trainer = quiet_trainer(1)
    trainer.fit(module, dm)
    ckpt = tmp_path / "expert.ckpt"
    trainer.save_checkpoint(ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["hyper_parameters"]["model"] = dataclasses.asdict(checkpoint["hyper_parameters"]["model"])
    torch.save(checkpoint, ckpt)
    out = tmp_path / "pool.jsonl"
    recipe = write_recipe(tmp_path / "recipe.yaml")
    with pytest.raises(SystemExit):
        main(["gnt-pool", "--config", recipe, "--expert", str(ckpt), "--num_tasks", "3", "--samples", "2",
              "--val_samples", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert f"--expert {str(ckpt)!r}: no row to write to the pool ({3 * 2 + 4} rows read, skipped 10 (unparseable_answer 10))" in err
    assert not out.exists()


def test_gnt_pool_command_reports_bad_input(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["gnt-pool", "--config", recipe, "--rollouts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p.jsonl")])
    assert exit_info.value.code == 2
    assert "no such rollouts file" in capsys.readouterr().err
