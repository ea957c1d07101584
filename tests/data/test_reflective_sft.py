"""Reflective SFT rows: GT+ as plain SFT, GNTs as (reflective prompt -> critique), only verified
critiques kept, validation rows never trained on; the file trains through the SFT head's loader."""

import json

import pytest
from harness import suite_tokenizer
from reflectrl_helpers import arithmetic_suite, write_pool

from r3lightning.cli.main import main
from r3lightning.data.demonstrations import conversation_trajectory, load_chat_jsonl
from r3lightning.data.reflectrl.reflective_sft import (
    build_sft_rows,
    keep_verified,
    scripted_critiques,
    suite_verifier,
    training_gnt_rows,
)
from r3lightning.envs.reflective import ReflectiveSuite, reflective_prompt, scripted_critic


@pytest.fixture()
def pool(tmp_path):
    return write_pool(tmp_path / "pool.jsonl", arithmetic_suite(), num_train=5)


def test_critiques_are_kept_only_when_their_answer_verifies(pool):
    verify = suite_verifier(arithmetic_suite())
    gnt = training_gnt_rows(pool)
    right = [f"Wrong step: x\nCorrection: y\n\\boxed{{{r['answer']}}}" for r in gnt]
    wrong = [f"\\boxed{{{int(r['answer']) + 2}}}" for r in gnt]
    candidates = [(gnt[0], [wrong[0], right[0]]), (gnt[1], [wrong[1]]), (gnt[2], ["no answer at all"]), (gnt[3], [])]
    kept, rate = keep_verified(candidates, verify)
    assert kept == [(gnt[0], right[0])]
    assert rate == pytest.approx(1 / 4)  # 4 candidates checked, 1 verified
    assert keep_verified([], verify) == ([], 0.0)


def test_rows_gt_plus_plain_and_gnt_reflective(pool):
    suite = arithmetic_suite()
    gnt = training_gnt_rows(pool)
    critiques = scripted_critiques(gnt, scripted_critic(suite))
    critiques[0] = ["\\boxed{-1}"]  # a critique that does not verify is dropped
    rows, stats = build_sft_rows(pool, critiques, suite_verifier(suite), suite.system_prompt, seed=3)
    assert stats["reflect_sft/critique_verified_rate"] == pytest.approx(4 / 5)
    assert (stats["reflect_sft/gt_plus_rows"], stats["reflect_sft/reflective_rows"], stats["reflect_sft/rows"]) == (5, 4, 9)
    train_ids = {r["task_id"] for r in pool if r["split"] == "train"}
    assert all(row["provenance"]["task_id"] in train_ids for row in rows)  # validation rows are never trained on
    gt_plus = next(r for r in rows if r["kind"] == "gt_plus")
    system, user, assistant = gt_plus["messages"]
    assert system == {"role": "system", "content": suite.system_prompt}
    source = next(p for p in pool if p["task_id"] == gt_plus["provenance"]["task_id"] and p["label"] == "gt_plus")
    assert (user["content"], assistant["content"]) == (source["prompt"], source["response"])
    reflective = next(r for r in rows if r["kind"] == "reflective")
    source = next(p for p in gnt if p["task_id"] == reflective["provenance"]["task_id"])
    assert reflective["messages"][1]["content"] == reflective_prompt(source["prompt"], source["response"])
    assert reflective["messages"][2]["content"].startswith("Wrong step: ")
    # Shuffled once: the two kinds are mixed, and the order is a function of the seed.
    assert [r["kind"] for r in rows] != sorted(r["kind"] for r in rows)
    again, _ = build_sft_rows(pool, critiques, suite_verifier(suite), suite.system_prompt, seed=3)
    assert again == rows


def test_gt_plus_only_rows(pool):
    suite = arithmetic_suite()
    rows, stats = build_sft_rows(pool, [], suite_verifier(suite), suite.system_prompt, reflective=False)
    assert {r["kind"] for r in rows} == {"gt_plus"} and stats["reflect_sft/rows"] == 5
    assert "reflect_sft/critique_verified_rate" not in stats


def test_reflect_sft_command_writes_what_the_sft_head_reads(tmp_path, pool, capsys):
    recipe = tmp_path / "recipe.yaml"
    inner = {"class_path": "r3lightning.envs.math_env.MathSuite", "init_args": {"source": "arithmetic", "num_val_tasks": 4, "instruction": ""}}
    template = "Q: {question}\nWrong: {attempt}\nFix it."
    spec = {"class_path": "r3lightning.envs.reflective.ReflectiveSuite",
            "init_args": {"suite": inner, "pool": str(tmp_path / "pool.jsonl"), "template": template}}
    recipe.write_text(json.dumps({"data": {"suite": spec}}))
    out = tmp_path / "sft.jsonl"
    main(["reflect-sft", "--config", str(recipe), "--pool", str(tmp_path / "pool.jsonl"), "--critic", "oracle", "--out", str(out)])
    assert "reflect_sft/critique_verified_rate 1.000" in capsys.readouterr().out
    conversations = load_chat_jsonl(str(out))
    assert len(conversations) == 10
    suite = ReflectiveSuite(arithmetic_suite(), str(tmp_path / "pool.jsonl"), template=template)
    # The reflective prompt of the SFT rows is the one the suite's reflective tasks show.
    prompts = {c[1]["content"] for c in conversations}
    assert {suite.train_task(i).prompt for i in range(5)} <= prompts
    tokenizer = suite_tokenizer(suite, num_tasks=4)
    trajectory = conversation_trajectory(conversations[0], tokenizer, "demo-0")
    assert trajectory.is_sft and len(trajectory.turns) == 1
    summary = json.loads((tmp_path / "sft.jsonl.summary.json").read_text())
    assert summary["reflect_sft/rows"] == 10


def test_reflect_sft_command_with_a_model_critic(tmp_path, pool, capsys):
    """The default critic is a model (the pool's expert unless --critic_model): a random tiny policy's
    critiques do not verify, so only the GT+ rows remain and the verified rate is reported as 0."""
    from harness import module_and_data, quiet_trainer

    module, dm = module_and_data(arithmetic_suite(), sft_steps=1)
    trainer = quiet_trainer(1)
    trainer.fit(module, dm)
    ckpt = tmp_path / "critic.ckpt"
    trainer.save_checkpoint(ckpt)
    recipe = tmp_path / "recipe.yaml"
    inner = {"class_path": "r3lightning.envs.math_env.MathSuite", "init_args": {"source": "arithmetic", "num_val_tasks": 4, "instruction": ""}}
    recipe.write_text(json.dumps({"data": {"suite": inner, "sampling": {"max_new_tokens": 4}, "agent": {"action_format": "raw"}}}))
    out = tmp_path / "sft.jsonl"
    main(["reflect-sft", "--config", str(recipe), "--pool", str(tmp_path / "pool.jsonl"),
                    "--critic_model", str(ckpt), "--critic_samples", "2", "--out", str(out)])
    stats = json.loads((tmp_path / "sft.jsonl.summary.json").read_text())
    assert stats["reflect_sft/critique_verified_rate"] == 0.0 and stats["reflect_sft/rows"] == 5
    assert stats["config"]["critic"] == "model"


def test_resolve_critique_corrects_the_first_step_the_gnt_does_not_share():
    from r3lightning.data.reflectrl.reflective_sft import resolve_critique

    gnt = "3-1=4\n4-2=2\n\\boxed{2}"
    solution = "3-1=2\n2-2=0\n\\boxed{0}"
    assert resolve_critique(gnt, solution) == "Wrong step: 3-1=4\nCorrection: 3-1=2; 2-2=0\n\\boxed{0}"
    # The first step agrees: the second is the wrong one, corrected from there.
    assert resolve_critique("3-1=2\n2-2=2\n\\boxed{2}", solution) == "Wrong step: 2-2=2\nCorrection: 2-2=0\n\\boxed{0}"
    # Every step agrees, the final answer does not: the boxed line is the wrong step.
    assert resolve_critique("3-1=2\n2-2=0\n\\boxed{2}", solution) == "Wrong step: \\boxed{2}\nCorrection: 2-2=0\n\\boxed{0}"
    # No steps in the GNT, an answer-only solution; a solution without a final answer gives nothing.
    assert resolve_critique("\\boxed{2}", "\\boxed{0}") == "Wrong step: \\boxed{2}\nCorrection: \\boxed{0}\n\\boxed{0}"
    assert resolve_critique(gnt, "3-1=2") is None
