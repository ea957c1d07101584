"""``r3l gnt-pool`` and ``r3l reflect-sft`` refuse empty inputs and out-of-range counts, name the file
and row of every bad row (undecodable bytes included), and count dropped rows by reason (issue 38,
item 4)."""

import json

import pytest
from reflectrl_helpers import arithmetic_suite, expert_rows, write_pool

from r3lightning.cli.main import main
from r3lightning.data.reflectrl.gnt_pool import write_jsonl


def write_recipe(path):
    suite = {"class_path": "r3lightning.envs.math_env.MathSuite", "init_args": {"source": "arithmetic", "num_val_tasks": 4, "instruction": ""}}
    path.write_text(json.dumps({"data": {"suite": suite, "agent": {"action_format": "raw"}}}))
    return str(path)


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return exit_info.value.code, capsys.readouterr().err


def test_an_empty_rollouts_file_is_refused(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    code, err = run(capsys, "gnt-pool", "--config", write_recipe(tmp_path / "r.yaml"), "--rollouts", str(tmp_path / "empty.jsonl"),
                    "--out", str(tmp_path / "pool.jsonl"))
    assert code == 2 and f"r3l gnt-pool: error: the rollouts file {str(tmp_path / 'empty.jsonl')!r} is empty" in err
    assert not (tmp_path / "pool.jsonl").exists()


def test_rollouts_without_a_usable_row_write_no_pool_and_say_why(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    code, err = run(capsys, "gnt-pool", "--config", write_recipe(tmp_path / "r.yaml"), "--rollouts", str(tmp_path / "bad.jsonl"),
                    "--out", str(tmp_path / "pool.jsonl"))
    assert code == 2 and "no row to write to the pool (0 rows read, skipped 2 (invalid_json 1, missing_field 1))" in err
    assert not (tmp_path / "pool.jsonl").exists()


@pytest.mark.parametrize("option, value, message", [
    ("--samples", "-1", "argument --samples: must be >= 1, got -1"),
    ("--val_samples", "-2", "argument --val_samples: must be >= 0, got -2"),
    ("--num_tasks", "0", "argument --num_tasks: must be >= 1, got 0"),
    ("--top_p", "1.5", "argument --top_p: must be > 0 and <= 1, got 1.5"),
    ("--samples", "two", "argument --samples: 'two' is not a whole number"),
])
def test_out_of_range_counts_are_refused_naming_the_option(tmp_path, capsys, option, value, message):
    code, err = run(capsys, "gnt-pool", "--config", write_recipe(tmp_path / "r.yaml"), "--expert", "x", option, value,
                    "--out", str(tmp_path / "pool.jsonl"))
    assert code == 2 and message in err


def test_undecodable_bytes_name_the_file_and_row_and_are_counted(tmp_path, capsys):
    suite = arithmetic_suite()
    rollouts = tmp_path / "rollouts.jsonl"
    write_jsonl(str(rollouts), expert_rows(suite, num_train=1))
    with open(rollouts, "ab") as handle:
        handle.write(b'{"prompt": "caf\xe9", "answer": "1", "response": "1"}\n')
    out = tmp_path / "pool.jsonl"
    main(["gnt-pool", "--config", write_recipe(tmp_path / "r.yaml"), "--rollouts", str(rollouts), "--out", str(out)])
    printed = capsys.readouterr()
    assert f"{rollouts}, row 11: not UTF-8 text (byte 0xe9 at column 16); skipped" in printed.err
    assert "skipped 1 (not_utf8 1)" in printed.out
    assert json.loads((tmp_path / "pool.jsonl.summary.json").read_text())["gnt/skipped"] == {"not_utf8": 1}


def reflect_recipe(tmp_path, pool):
    inner = {"class_path": "r3lightning.envs.math_env.MathSuite", "init_args": {"source": "arithmetic", "num_val_tasks": 4, "instruction": ""}}
    (tmp_path / "r.json").write_text(json.dumps({"data": {"suite": inner}}))
    return str(tmp_path / "r.json")


def test_reflect_sft_counts_and_reports_rows_of_an_unknown_label(tmp_path, capsys):
    pool = tmp_path / "pool.jsonl"
    rows = write_pool(pool, arithmetic_suite(), num_train=5)
    rows[0] = {**rows[0], "label": "negative"}
    write_jsonl(str(pool), rows)
    out = tmp_path / "sft.jsonl"
    main(["reflect-sft", "--config", reflect_recipe(tmp_path, pool), "--pool", str(pool), "--critic", "oracle", "--out", str(out)])
    printed = capsys.readouterr()
    assert f"r3l reflect-sft: {pool}, row 1: unknown label 'negative' (not 'gnt' or 'gt_plus'); dropped" in printed.err
    assert "dropped 1 (unknown_label 1)" in printed.out
    assert json.loads((tmp_path / "sft.jsonl.summary.json").read_text())["reflect_sft/dropped"] == {"unknown_label": 1}


def test_reflect_sft_refuses_an_empty_pool_an_undecodable_one_and_bad_counts(tmp_path, capsys):
    pool = tmp_path / "pool.jsonl"
    pool.write_text("")
    args = ["reflect-sft", "--config", reflect_recipe(tmp_path, pool), "--pool", str(pool), "--critic", "oracle", "--out", str(tmp_path / "o.jsonl")]
    code, err = run(capsys, *args)
    assert code == 2 and f"GNT pool {str(pool)!r} has no rows" in err
    pool.write_bytes(b'{"label": "gnt"}\n\xff\xfe\n')
    code, err = run(capsys, *args)
    assert code == 2 and f"{pool}, row 2: not UTF-8 text (byte 0xff at column 1)" in err
    code, err = run(capsys, *args, "--critic_samples", "0")
    assert code == 2 and "argument --critic_samples: must be >= 1, got 0" in err
