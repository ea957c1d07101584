"""Every YAML under configs/ parses with the real ``r3l`` parser; stacking, errors and --help behave.

Parsing uses the R3LightningCLI parser built once (``harness.parse_only_cli``: the real subclass, its
trainer defaults and every dataclass/class signature), stopped right after parsing, so nothing is
seeded or instantiated, no model is built, nothing is trained and no optional strategy package
(deepspeed) is imported.

Complete recipes (files that name ``data.suite``) are parsed alone; fragments (``configs/algorithms``,
``configs/trainer``, ``configs/engine``, anything without a suite) are parsed stacked on the CPU
quickstart recipe, exactly as ``r3l fit --config BASE --config FRAGMENT`` would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import sys
from pathlib import Path

import pytest
import yaml
from harness import BASE_RECIPE as BASE, CONFIGS, ROOT, parse_only_cli

from r3lightning.cli.main import R3LightningCLI

FRAGMENT_DIRS = {"algorithms", "trainer", "engine"}
ALL_YAML = sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


@pytest.fixture(scope="module")
def cli() -> R3LightningCLI:
    return parse_only_cli()


def _load(path: Path) -> dict:
    with open(path) as handle:
        return yaml.safe_load(handle) or {}


def _is_fragment(path: Path) -> bool:
    rel = path.relative_to(CONFIGS)
    if rel.parts[0] in FRAGMENT_DIRS:
        return True
    data = _load(path).get("data") or {}
    return "suite" not in data


def _args_for(path: Path) -> list[str]:
    if _is_fragment(path):
        return ["fit", "--config", str(BASE), "--config", str(path)]
    return ["fit", "--config", str(path)]


def _parse_error(cli: R3LightningCLI, args: list[str]) -> str:
    """stderr of a parse that must fail with a non-zero SystemExit."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        cli.parser.parse_args(args)
    assert exit_info.value.code not in (0, None)
    return err.getvalue()


def _leaves(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _same(expected, actual) -> bool:
    """``actual`` (resolved, defaults filled in) agrees with every value ``expected`` (the file) sets."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and _same(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return False
        if any(isinstance(e, (dict, list)) for e in expected):  # e.g. callbacks: compare in order
            return all(_same(e, a) for e, a in zip(expected, actual))
        return sorted(map(str, expected)) == sorted(map(str, actual))  # sets (FSDP wrap policy) lose order
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and isinstance(actual, (int, float)):
        return float(expected) == float(actual)
    return str(expected) == str(actual)


def test_configs_exist():
    names = {p.relative_to(CONFIGS).as_posix() for p in ALL_YAML}
    for algo in ("grpo", "dr_grpo", "gspo", "rloo", "reinforce", "opmd", "raft", "reflect_grpo", "critique_grpo"):
        assert f"algorithms/{algo}.yaml" in names
    for trainer in ("cpu", "gpu", "ddp", "fsdp", "deepspeed_zero2"):
        assert f"trainer/{trainer}.yaml" in names
    assert BASE.relative_to(CONFIGS).as_posix() in names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_every_yaml_parses_and_its_keys_win(cli, path):
    """The file parses (stacked on the base recipe when it is a fragment) and every value it sets is
    the value in the resolved config: a later --config overrides exactly the keys it names."""
    cfg = cli.parser.parse_args(_args_for(path))
    resolved = yaml.safe_load(cli.parser.dump(cfg, skip_none=False))["fit"]
    for key, expected in _leaves(_load(path)):
        node = resolved
        for part in key:
            part = part.rstrip("+")  # "callbacks+:" appends to the list named "callbacks"
            assert isinstance(node, dict) and part in node, f"{path.name}: {'.'.join(key)} missing after parsing"
            node = node[part]
        if key[-1].endswith("+") and isinstance(expected, list):
            node = node[-len(expected) :]
        assert _same(expected, node), f"{path.name}: {'.'.join(key)} = {node!r}, the file sets {expected!r}"


def test_stacking_overrides_only_the_keys_a_fragment_sets(cli):
    """base <- gspo <- rloo <- command line: each layer replaces only what it names. Presets name every
    method-defining key, so the last preset wins whole; the recipe keeps everything else."""
    cfg = cli.parser.parse_args(
        [
            "fit",
            "--config", str(BASE),
            "--config", str(CONFIGS / "algorithms" / "gspo.yaml"),
            "--config", str(CONFIGS / "algorithms" / "rloo.yaml"),
            "--model.algorithm.kl_coef", "0.01",
        ]
    ).fit
    algo = cfg.model.algorithm
    assert (algo.advantage, algo.policy_loss, algo.aggregation) == ("rloo", "pg", "seq_mean_token_sum")  # rloo
    assert (algo.clip_eps_low, algo.clip_eps_high) == (0.2, 0.2)  # rloo's own, not gspo's
    assert algo.kl_coef == 0.01  # the command line comes last
    base = _load(BASE)
    assert cfg.model.optim.lr == base["model"]["optim"]["lr"]  # the base recipe's
    assert cfg.model.optim.micro_batch_size == base["model"]["optim"]["micro_batch_size"]
    assert cfg.model.model.tiny.hidden_size == base["model"]["model"]["tiny"]["hidden_size"]
    assert cfg.trainer.max_steps == base["trainer"]["max_steps"]


RECIPES = sorted(p for p in ALL_YAML if not _is_fragment(p))
PRESETS = sorted((CONFIGS / "algorithms").glob("*.yaml"))


def _method_sections(recipe: Path) -> str:
    """What of a recipe a stacked preset merges with: its algorithm, explorer and replay sections."""
    config = _load(recipe)
    model, data = config.get("model") or {}, config.get("data") or {}
    return repr([model.get("algorithm"), data.get("explorer"), data.get("replay")])


# One recipe per distinct method sections: two recipes equal there stack a preset alike (the parser
# merges a preset's keys with those sections only), so the others would repeat the same parses.
RECIPES_BY_METHOD_SECTIONS = list({_method_sections(p): p for p in RECIPES}.values())


def test_every_preset_sets_every_method_defining_key_and_its_explorer():
    from r3lightning.algos.objective import METHOD_FIELDS, AlgorithmConfig

    assert set(METHOD_FIELDS) <= {f.name for f in dataclasses.fields(AlgorithmConfig)}
    for path in PRESETS:
        preset = _load(path)
        assert set(preset["model"]["algorithm"]) == set(METHOD_FIELDS), path.name
        explorer = preset["data"]["explorer"]
        assert "class_path" in explorer and "init_args" in explorer, path.name
        assert "enabled" in preset["data"]["replay"], path.name
        assert "enabled" in preset["model"]["algorithm"]["ranking"], path.name


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_a_preset_means_the_same_method_on_every_recipe(cli, preset):
    """Stacked on any recipe (quickstart, examples, GPU recipes), a preset's method-defining fields
    and its explorer (class and the init_args it names) are exactly the preset's. Recipes are taken
    one per distinct algorithm/explorer/replay sections; no recipe nests another YAML file, which
    could reach those keys from elsewhere."""
    assert not [p for p in RECIPES if ".yml" in repr(_load(p)).replace(".yaml", ".yml")]
    expected = _load(preset)
    algorithm, explorer = expected["model"]["algorithm"], expected["data"]["explorer"]
    for recipe in RECIPES_BY_METHOD_SECTIONS:
        parsed = cli.parser.parse_args(["fit", "--config", str(recipe), "--config", str(preset)])
        cfg = parsed.fit
        resolved = cfg.as_dict()  # the parsed values (no dump: 200 pairs, a third of the time)
        for key, value in algorithm.items():
            assert _same(value, resolved["model"]["algorithm"][key]), f"{recipe.name} + {preset.name}: {key}"
        for key, value in expected["data"]["replay"].items():
            assert _same(value, resolved["data"]["replay"][key]), f"{recipe.name} + {preset.name}: replay {key}"
        assert cfg.data.explorer.class_path == explorer["class_path"], f"{recipe.name} + {preset.name}"
        init_args = vars(getattr(cfg.data.explorer, "init_args", None) or argparse.Namespace())
        for key, value in explorer["init_args"].items():
            assert _same(value, init_args[key]), f"{recipe.name} + {preset.name}: explorer {key}"


def test_quickstart_plus_grpo_is_plain_grpo(cli):
    cfg = cli.parser.parse_args(["fit", "--config", str(CONFIGS / "examples" / "r3l_procedural_d1_cpu.yaml"), "--config", str(PRESETS[0].parent / "grpo.yaml")]).fit
    assert cfg.data.explorer.class_path == "r3lightning.rollout.explorers.base.SampleExplorer"
    assert not vars(getattr(cfg.data.explorer, "init_args", None) or argparse.Namespace())
    algo = cfg.model.algorithm
    assert (algo.advantage, algo.positive_amplification, algo.pivotal_credit, algo.policy_loss, algo.sft_weight) == (
        "grpo", False, False, "ppo_clip", 0.0
    )


def test_trainer_fragments_stack_with_algorithm_fragments(cli):
    cfg = cli.parser.parse_args(
        [
            "fit",
            "--config", str(BASE),
            "--config", str(CONFIGS / "trainer" / "cpu.yaml"),
            "--config", str(CONFIGS / "trainer" / "ddp.yaml"),
            "--config", str(CONFIGS / "algorithms" / "dr_grpo.yaml"),
        ]
    ).fit
    assert (cfg.trainer.accelerator, cfg.trainer.strategy, cfg.trainer.devices) == ("cpu", "ddp", 2)
    assert cfg.trainer.use_distributed_sampler is False and str(cfg.trainer.precision) == "32"
    assert cfg.model.algorithm.advantage == "dr_grpo" and cfg.trainer.max_steps == _load(BASE)["trainer"]["max_steps"]


def test_print_config_shows_the_stacked_result(cli):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.parser.parse_args(
            ["fit", "--config", str(BASE), "--config", str(CONFIGS / "algorithms" / "raft.yaml"), "--print_config"]
        )
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(out.getvalue())
    assert printed["model"]["algorithm"]["advantage"] == "raft"
    assert printed["model"]["algorithm"]["policy_loss"] == "pg"
    assert printed["model"]["phases"]["warmstart"]["lr"] == 1.0e-3
    assert printed["data"]["suite"]["class_path"] == "r3lightning.envs.math_env.MathSuite"


def test_deepspeed_fragment_parses_without_importing_deepspeed(cli):
    cfg = cli.parser.parse_args(_args_for(CONFIGS / "trainer" / "deepspeed_zero2.yaml")).fit
    assert cfg.trainer.strategy == "deepspeed_stage_2"
    assert "deepspeed" not in sys.modules


def test_fsdp_fragment_builds_its_strategy(cli):
    """The FSDP strategy's init_args are valid for FSDPStrategy (constructed on CPU; not set up)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    strategy_cfg = cli.parser.parse_args(_args_for(CONFIGS / "trainer" / "fsdp.yaml")).fit.trainer.strategy
    init_args = dict(vars(strategy_cfg.init_args))
    assert Qwen2DecoderLayer in init_args["auto_wrap_policy"]
    strategy = FSDPStrategy(**init_args)
    assert strategy.sharding_strategy.name == "FULL_SHARD"


def test_cpu_ddp_trainer_uses_gloo(tmp_path, monkeypatch):
    """cpu + ddp instantiate a 2-process DDP trainer on CPU whose process group backend is gloo."""
    from lightning.pytorch.strategies import DDPStrategy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["r3l"])
    cli = R3LightningCLI(
        args=[
            "--config", str(BASE),
            "--config", str(CONFIGS / "trainer" / "cpu.yaml"),
            "--config", str(CONFIGS / "trainer" / "ddp.yaml"),
            "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false",
        ],
        run=False,
    )
    trainer = cli.trainer
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2 and trainer.world_size == 2
    assert trainer.strategy._get_process_group_backend() == "gloo"


def test_unknown_key_is_a_clear_error(cli, tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  algorithm:\n    alpah: 2.0\n")
    stderr = _parse_error(cli, ["fit", "--config", str(BASE), "--config", str(typo)])
    assert "model.algorithm.alpah" in stderr
    stderr = _parse_error(cli, ["fit", "--config", str(BASE), "--trainer.max_stepz", "3"])
    assert "--trainer.max_stepz" in stderr


def test_wrong_type_is_a_clear_error(cli, tmp_path):
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  algorithm:\n    alpha: lots\n")
    stderr = _parse_error(cli, ["fit", "--config", str(BASE), "--config", str(wrong)])
    assert "model.algorithm.alpha" in stderr and "lots" in stderr
    stderr = _parse_error(cli, ["fit", "--config", str(BASE), "--model.algorithm.advantage", "grpoo"])
    assert "model.algorithm.advantage" in stderr and "dr_grpo" in stderr  # names the key and the choices
    stderr = _parse_error(cli, ["fit", "--config", str(BASE), "--data.group_size", "eight"])
    assert "data.group_size" in stderr


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_help_documents_fields_from_docstrings(cli):
    """``r3l fit --help`` shows each field's docstring line (help text is wrapped, so compare flattened)."""
    text = _flat(cli._subcommand_parsers["fit"].format_help())
    for fragment in (
        "--model.algorithm.alpha ALPHA amplification factor.",  # AlgorithmConfig
        "value given to max-reward samples",  # AlgorithmConfig.max_reward_mode
        "sequences per forward/backward pass.",  # OptimConfig.micro_batch_size
        "target BPE vocabulary size",  # TinyModelSpec.vocab_size
        "rollout budget per task (N in the papers).",  # RolloutDataModule.group_size
    ):
        assert fragment in text, f"--help lacks {fragment!r}"


@pytest.mark.parametrize(
    "suite, fragments",
    [
        ("r3lightning.envs.math_env.MathSuite", ["--data.suite.max_attempts", "answers per episode"]),
        ("r3lightning.envs.textworld_procedural.ProceduralWorldSuite", ["--data.suite.difficulty", "locked container"]),
    ],
)
def test_suite_help_documents_its_arguments(cli, suite, fragments):
    """``r3l fit --data.suite.help CLASS`` prints the suite's constructor docs."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.parser.parse_args(["fit", "--data.suite.help", suite])
    assert exit_info.value.code in (0, None)
    text = _flat(out.getvalue())
    for fragment in fragments:
        assert fragment in text


GPU_RECIPES = {
    "r3l_alfworld_qwen2.5-1.5b.yaml": ("r3lightning.envs.alfworld_env.ALFWorldSuite", "max_turns", 25),
    "r3l_scienceworld_qwen2.5-1.5b.yaml": ("r3lightning.envs.scienceworld_env.ScienceWorldSuite", "max_turns", 30),
    "r3l_math_qwen2.5-1.5b.yaml": ("r3lightning.envs.math_env.MathSuite", "max_attempts", 3),
}


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_run_r3l_on_qwen(cli, name):
    """The GPU recipes (parsed only: nothing is downloaded) share the R³L settings of issue #4 and
    say in their header that they are untested and how to run them."""
    path = CONFIGS / "recipes" / name
    suite, limit_key, limit = GPU_RECIPES[name]
    cfg = cli.parser.parse_args(_args_for(path)).fit
    assert cfg.model.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (cfg.data.group_size, cfg.model.optim.lr, cfg.model.algorithm.alpha) == (8, 1.0e-6, 3.0)
    assert cfg.model.algorithm.positive_amplification and cfg.model.algorithm.pivotal_credit
    assert cfg.data.explorer.class_path == "r3lightning.rollout.explorers.reflect_retry.ReflectRetryExplorer"
    assert (cfg.model.engine.backend, cfg.trainer.accelerator, str(cfg.trainer.precision)) == ("vllm", "gpu", "bf16-mixed")
    assert [c.class_path for c in cfg.trainer.callbacks] == ["r3lightning.callbacks.VLLMWeightSync"]
    assert cfg.data.suite.class_path == suite and getattr(cfg.data.suite.init_args, limit_key) == limit
    header = path.read_text().split("\nseed_everything")[0]
    assert "NOT RUN AT THIS SIZE" in header and "tests/test_recipes.py" in header and f"r3l fit --config configs/recipes/{name}" in header


def test_comparison_arms_parse_on_the_quickstart_as_their_presets(cli, monkeypatch):
    """experiments/compare_algorithms.py: every arm parses on the recipe and is its preset as it is;
    --arm adds a preset with overrides."""
    import argparse

    from experiments import compare_algorithms as compare

    monkeypatch.chdir(ROOT)  # the arms name their presets relative to the repository root
    args = argparse.Namespace(recipe="configs/examples/r3l_procedural_d1_cpu.yaml", warmup_steps=None, rl_steps=None, val_every=None, alpha=None)
    compare.recipe_defaults(args)
    recipe = _load(CONFIGS / "examples" / "r3l_procedural_d1_cpu.yaml")
    assert args.warmup_steps + args.rl_steps == recipe["trainer"]["max_steps"]
    name, arm = compare.parse_arm("r3l_sft01=r3l,model.algorithm.sft_weight=0.1")
    assert name == "r3l_sft01" and arm[-2:] == ["--model.algorithm.sft_weight", "0.1"]
    for method, arm in [*compare.METHODS.items(), (name, arm)]:
        algorithm = cli.parser.parse_args(["fit", "--config", args.recipe, *arm]).fit.model.algorithm
        preset = _load(CONFIGS / "algorithms" / f"{method.split('_sft')[0]}.yaml")["model"]["algorithm"]
        assert algorithm.positive_amplification == preset["positive_amplification"], method
        assert algorithm.pivotal_credit == preset["pivotal_credit"], method
        if method in compare.METHODS:
            assert (method in compare.AMPLIFIED) == preset["positive_amplification"], method
    assert cli.parser.parse_args(["fit", "--config", args.recipe, *arm]).fit.model.algorithm.sft_weight == 0.1
    # Preset "recipe": the recipe's own method, overrides only.
    name, arm = compare.parse_arm("quickstart_sft1=recipe,model.algorithm.sft_weight=1.0")
    assert arm == ["--model.algorithm.sft_weight", "1.0"]
    plain = cli.parser.parse_args(["fit", "--config", args.recipe]).fit.model.algorithm.as_dict()
    changed = cli.parser.parse_args(["fit", "--config", args.recipe, *arm]).fit.model.algorithm.as_dict()
    assert changed == {**plain, "sft_weight": 1.0}
    with pytest.raises(SystemExit, match="configs/algorithms or 'recipe'"):
        compare.parse_arm("x=no_such_preset")


def test_comparison_reuses_only_runs_of_the_same_schedule(tmp_path):
    """compare_algorithms --reuse_results: runs of the requested methods and seeds are taken from an
    earlier JSON with the same schedule; a different schedule is refused, naming the file and setting."""
    import argparse
    import json

    import pytest

    from experiments import compare_algorithms as compare

    schedule = {"recipe": "configs/examples/r3l_procedural_d1_cpu.yaml", "warmup_steps": 210, "rl_steps": 30, "val_every": 30,
                "alpha": 3.0, "shared_warmstart": True, "threads": 1}
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"config": {**schedule, "workers": 2},
                                    "per_seed": {"grpo": {"0": {"final_greedy": 0.25}, "1": {"final_greedy": 0.5}}}}))
    # Written before --warmstart_override and --warmstart_threads existed: those runs had no override and
    # trained their warm-starts at torch's default thread count (0).
    args = argparse.Namespace(**schedule, warmstart_override=[], warmstart_threads=0, methods=["grpo", "r3l_wo_credit"],
                              seeds=[1, 2])
    assert compare.reusable_runs(str(previous), args) == {"grpo": {"1": {"final_greedy": 0.5}}, "r3l_wo_credit": {}}
    args.warmstart_threads = 1
    with pytest.raises(ValueError, match=r"previous\.json: its runs used warmstart_threads=0"):
        compare.reusable_runs(str(previous), args)
    args.warmstart_threads, args.threads = 0, 2
    with pytest.raises(ValueError, match=r"previous\.json: its runs used threads=1"):
        compare.reusable_runs(str(previous), args)
    args.threads = 1
    args.warmstart_override = ["model.phases.warmstart.demos.success_reflection_share=0.25"]
    with pytest.raises(ValueError, match=r"previous\.json: its runs used warmstart_override=\[\]"):
        compare.reusable_runs(str(previous), args)
    args.warmstart_override = []
    args.rl_steps = 40
    with pytest.raises(ValueError, match=r"previous\.json: its runs used rl_steps=30"):
        compare.reusable_runs(str(previous), args)


def test_comparison_warm_start_resumes_into_every_arm(tmp_path, monkeypatch):
    """experiments/compare_algorithms.py end to end on a tiny recipe: the shared warm-start checkpoint
    resumes into an arm of another method, which trains with its own algorithm (the checkpoint keeps
    its hyper-parameters; the arm runs with --resume_with config)."""
    import argparse

    from harness import TINY_CLI_RUN

    from experiments import compare_algorithms as compare

    monkeypatch.chdir(ROOT)
    recipe = {
        **TINY_CLI_RUN,
        "trainer": {**TINY_CLI_RUN["trainer"], "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path)}}},
        "model": {**TINY_CLI_RUN["model"], "phases": {"warmstart": {"steps": 1}}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # --warmstart_override reaches the warm-start only, but for its demos (the demonstrations' schedule,
    # which the config check reads against the warm-up length): the arms describe their warm-start.
    args = argparse.Namespace(recipe=str(path), warmup_steps=1, rl_steps=1, val_every=1, alpha=None, threads=0,
                              reuse_warmstart=False,
                              warmstart_override=["model.phases.warmstart.lr=0.0123",
                                                  "model.phases.warmstart.demos.success_reflection_from_step=7"])
    checkpoint, warm = compare.warm_start(0, args, str(tmp_path))
    assert warm["step"] == 1
    warm_config = yaml.safe_load((tmp_path / "warmstart_seed0" / "version_0" / "config.yaml").read_text())
    assert warm_config["model"]["phases"]["warmstart"]["lr"] == 0.0123
    result = compare.run_method("rloo", compare.METHODS["rloo"], 0, checkpoint, args, str(tmp_path))
    assert [step for step, _ in result["curve_greedy"]] == [1, 2]
    saved = yaml.safe_load((tmp_path / "rloo_seed0" / "version_0" / "config.yaml").read_text())
    assert saved["model"]["algorithm"]["advantage"] == "rloo"
    assert saved["model"]["phases"]["warmstart"]["lr"] != 0.0123
    assert warm_config["model"]["phases"]["warmstart"]["demos"]["success_reflection_from_step"] == 7
    assert saved["model"]["phases"]["warmstart"]["demos"]["success_reflection_from_step"] == 7


def test_a_comparison_over_two_cores_reproduces_the_sequential_one(tmp_path, monkeypatch):
    """compare_algorithms schedules warm-starts and arms over worker processes (1 torch thread each),
    each arm starting once its seed's warm-start is trained: every run's numbers equal those of the same
    comparison run one job at a time, and the record gives the comparison's and each arm's wall time."""
    import json

    from harness import TINY_CLI_RUN

    from experiments import compare_algorithms as compare

    monkeypatch.chdir(ROOT)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        **TINY_CLI_RUN,
        "trainer": {**TINY_CLI_RUN["trainer"], "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger"}},
        "model": {**TINY_CLI_RUN["model"], "phases": {"warmstart": {"steps": 1}}},
    }))
    records = {}
    for cores in (2, 1):
        out = tmp_path / f"cores{cores}" / "compare.json"
        monkeypatch.setattr(sys, "argv", [
            "compare_algorithms", "--out", str(out), "--recipe", str(recipe), "--seeds", "0", "1", "--methods", "grpo",
            "rloo", "--warmup_steps", "1", "--rl_steps", "1", "--val_every", "1", "--cores", str(cores), "--threads", "1"])
        compare.main()
        records[cores] = json.loads(out.read_text())
    parallel, sequential = records[2], records[1]
    for method in ("grpo", "rloo"):
        for seed in ("0", "1"):
            run, again = parallel["per_seed"][method][seed], sequential["per_seed"][method][seed]
            assert [step for step, _ in run["curve_greedy"]] == [1, 2]
            assert {k: v for k, v in run.items() if k != "wall_s"} == {k: v for k, v in again.items() if k != "wall_s"}
    assert parallel["warm_start"].keys() == {"0", "1"}
    figures = parallel["figures"]
    assert figures["comparison_wall_s"] > 0 and figures["warmstart_wall_s_total"] > 0
    assert figures["wall_s_total_by_arm"].keys() == {"grpo", "rloo"}


def test_comparison_record_of_a_partial_run_is_reusable(tmp_path):
    """compare_algorithms writes its JSON after every finished run: a comparison stopped part-way
    leaves a record whose runs --reuse_results takes up, and whose figures cover only those runs."""
    import argparse

    from experiments import compare_algorithms as compare

    args = argparse.Namespace(
        out=str(tmp_path / "partial.json"), recipe="r.yaml", warmup_steps=2, rl_steps=3, val_every=1, alpha=None,
        shared_warmstart=True, warmstart_override=[], threads=1, warmstart_threads=1, methods=["grpo", "r3l"], seeds=[0, 1],
    )
    run = {"final_greedy": 0.25, "final_sampled": 0.5, "last3_mean_greedy": 0.2, "last3_mean_sampled": 0.4,
           "wall_s": 10.0, "generated_tokens": 100.0, "rl_rollout_means": {"rollout/retry_improvement_rate": 0.3}}
    figures, reported = compare.write_record(
        args, {"grpo": {"0": run}, "r3l": {}}, {"0": {"val/success_rate_greedy": 0.1}})
    assert figures["grpo_final_val_success_greedy_mean"] == 0.25
    assert "r3l_final_val_success_greedy_mean" not in figures
    assert reported == {"grpo": {"0": run}, "r3l": {}}
    assert compare.reusable_runs(args.out, args) == {"grpo": {"0": run}, "r3l": {}}


def test_comparison_reuses_runs_only_from_the_same_warm_start(tmp_path):
    """--reuse_results refuses a seed whose warm-start validated differently from this comparison's
    (retrained on another machine or by other code: its runs would be paired with another start)."""
    import argparse
    import json

    import pytest

    from experiments import compare_algorithms as compare

    schedule = {"recipe": "r.yaml", "warmup_steps": 2, "rl_steps": 3, "val_every": 1, "alpha": None,
                "shared_warmstart": False, "warmstart_override": [], "threads": 1, "warmstart_threads": 1}
    warm = {"0": {"step": 2, "val/success_rate_greedy": 0.4375, "val/success_rate": 0.3125, "reused": True},
            "1": {"step": 2, "val/success_rate_greedy": 0.109375, "val/success_rate": 0.265625, "wall_s": 9.0}}
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({"config": schedule, "warm_start": warm,
                                    "per_seed": {"grpo": {"0": {"final_greedy": 0.25}, "1": {"final_greedy": 0.5}}}}))
    args = argparse.Namespace(**schedule, methods=["grpo"], seeds=[0, 1])
    # The same warm-starts (one reused here, one retrained identically: bookkeeping keys differ).
    same = {"0": {**warm["0"], "reused": False, "wall_s": 4.0}, "1": {**warm["1"], "wall_s": 7.5}}
    assert compare.reusable_runs(str(previous), args, same) == {"grpo": {"0": {"final_greedy": 0.25}, "1": {"final_greedy": 0.5}}}
    other = {**same, "1": {**same["1"], "val/success_rate_greedy": 0.203125}}
    with pytest.raises(ValueError, match=r"previous\.json: seed 1's warm-start validated .*val/success_rate_greedy.*0\.109375.*0\.203125"):
        compare.reusable_runs(str(previous), args, other)


def test_reflectrl_comparison_arms_name_real_stage_ones_and_teachers():
    """experiments/compare_reflectrl.py: every stage-2 arm names a stage-1 pipeline that has an SFT file
    and a teacher mode the distillation phase knows; no arm is seed-literal."""
    from typing import get_args

    from r3lightning.training.phases import TeacherMode
    from experiments import compare_reflectrl as compare

    for arm, (pipeline, beta, teacher) in compare.ARMS.items():
        assert compare.STAGE_ONE[pipeline] in compare.SFT_FILES, arm
        assert teacher in get_args(TeacherMode) and beta >= 0, arm
    # The CPU recipe's student is built at random: no M_S for a seed_literal arm (the phase refuses it).
    assert all(teacher != "seed_literal" for _, _, teacher in compare.ARMS.values())


def test_reflectrl_comparison_config_parses_with_its_trace_callback(tmp_path):
    """experiments/compare_reflectrl.py: the stage config it writes parses with ``r3l fit``, its
    DistillTrace callback included (its class path must import from the repository root, where the
    comparison runs as ``python -m experiments.compare_reflectrl``)."""
    import argparse

    import yaml

    from experiments import compare_reflectrl as compare
    from r3lightning.cli.main import R3LightningCLI

    pool = tmp_path / "pool.jsonl"
    pool.write_text("")
    config = compare.student_config(argparse.Namespace(pool=str(pool)), tmp_path / "sft.jsonl", tmp_path, "arm", 4, 0.05, "context_distillation")
    path = tmp_path / "arm.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cli = R3LightningCLI(args=["--config", str(path)], run=False)
    assert any(type(cb).__name__ == "DistillTrace" for cb in cli.trainer.callbacks)


def test_gpu_session_override_keeps_the_recipes_method(cli):
    """benchmarks/recipe_gpu_override.yaml (the GPU session's 20-step recipe run) parses on the R³L
    math recipe and changes only size, engine and callbacks: the method, explorer, suite and precision
    are the recipe's."""
    recipe = CONFIGS / "recipes" / "r3l_math_qwen2.5-1.5b.yaml"
    base = cli.parser.parse_args(["fit", "--config", str(recipe)]).fit
    cfg = cli.parser.parse_args(["fit", "--config", str(recipe), "--config", str(ROOT / "benchmarks" / "recipe_gpu_override.yaml")]).fit
    assert cfg.model.algorithm == base.model.algorithm
    assert (cfg.data.explorer.class_path, cfg.data.suite) == (base.data.explorer.class_path, base.data.suite)
    assert cfg.data.explorer.init_args.retry and cfg.data.explorer.init_args.meta_tasks
    assert (cfg.trainer.accelerator, str(cfg.trainer.precision), cfg.trainer.max_steps) == ("gpu", "bf16-mixed", 20)
    assert (cfg.model.model.name_or_path, cfg.model.engine.backend, cfg.model.engine.hf_decode) == ("", "hf", "fused")
    assert cfg.trainer.callbacks == []


RUNNABLE = sorted(p for p in ALL_YAML if not _is_fragment(p))


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_configs_sample_with_the_seed_they_always_had(cli, path):
    """The sampling seed now follows ``seed_everything`` unless ``data.seed`` is given; every shipped
    config sets ``seed_everything: 0``, so its rollouts keep the seed 0 of the old ``data.seed`` default."""
    from r3lightning.cli.main import resolve_sampling_seed

    section = cli.parser.parse_args(["fit", "--config", str(path)]).fit
    resolve_sampling_seed(section)
    assert section.data.seed == 0


@pytest.mark.parametrize("extra, expected", [(["--seed_everything", "1"], 1), (["--seed_everything", "1", "--data.seed", "5"], 5),
                                             (["--seed_everything", "7"], 7)])
def test_the_sampling_seed_follows_seed_everything_unless_data_seed_is_given(extra, expected):
    cli = R3LightningCLI(args=["--config", str(BASE), *extra], run=False)
    assert cli.datamodule.seed == expected
    assert cli.datamodule.rollout_seed(3) != R3LightningCLI(args=["--config", str(BASE), "--data.seed", str(expected + 1)], run=False).datamodule.rollout_seed(3)


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "examples/r3l_procedural_d1_cpu.yaml"])
def test_a_recipes_seed_spread_describes_the_recipe_itself_and_no_preset_stacked_on_it(cli, recipe):
    """The band a recipe prints beside a run (``SeedSpread``) is shown for the recipe as it is and refused
    for another method stacked on it (``spread_differences``, read by PhaseReport)."""
    from r3lightning.callbacks.phase_report import SeedSpread, spread_differences
    from r3lightning.rollout.explorers.base import SampleExplorer

    def differences(*extra):
        cfg = cli.parser.parse_args(["fit", "--config", str(CONFIGS / recipe), *extra]).fit
        report = next(c for c in cfg.trainer.callbacks if c.class_path.endswith("PhaseReport"))
        spread = SeedSpread(**vars(report.init_args.seed_spread))
        explorer = SampleExplorer()
        if cfg.data.explorer is not None:
            module, name = cfg.data.explorer.class_path.rsplit(".", 1)
            explorer = getattr(importlib.import_module(module), name)(**vars(getattr(cfg.data.explorer, "init_args", None) or argparse.Namespace()))
        return spread_differences(spread, cfg.trainer.max_steps, cfg.model.algorithm, explorer)

    assert differences() == []
    own = {"quickstart.yaml": "grpo", "examples/r3l_procedural_d1_cpu.yaml": "r3l"}[recipe]  # the recipe's own method
    assert differences("--config", str(CONFIGS / "algorithms" / f"{own}.yaml")) == []
    for preset in [p for p in PRESETS if p.stem != own]:
        assert differences("--config", str(preset)), preset.name
    assert differences("--trainer.max_steps", "8")
