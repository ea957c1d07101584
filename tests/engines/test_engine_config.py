"""``engine.hf_decode`` picks one of the ``hf`` engine's decoding paths; ``auto`` is the path the engine
took by default before the knob (the eager fused step on the CPU, transformers' compiled ``generate``
with CUDA), and the four keys it replaced are refused naming it."""

import sys
from unittest import mock

import pytest

from r3lightning.cli.main import main
from r3lightning.engines.config import REPLACED_KEYS, EngineConfig, build_engine, hf_decode_path, replaced_key_note
from r3lightning.training.models import TinyModelSpec, build_tiny_model


@pytest.mark.parametrize(
    "choice, on_cuda, path",
    [
        ("auto", False, "fused"),
        ("auto", True, "generate_compiled"),
        ("forward", True, "forward"),
        ("fused", True, "fused"),
        ("fused_compiled", True, "fused_compiled"),
        ("generate_compiled", False, "generate_compiled"),
    ],
)
def test_hf_decode_names_its_path_and_auto_follows_the_device(choice, on_cuda, path):
    assert hf_decode_path(choice, on_cuda) == path


@pytest.mark.parametrize("choice", ["forward", "fused", "fused_compiled", "generate_compiled"])
def test_the_built_engine_decodes_on_the_named_path(world_tokenizer, choice):
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    assert build_engine(EngineConfig(hf_decode=choice), model, world_tokenizer).decode == choice


def test_auto_on_the_cpu_builds_the_fused_path_and_a_bad_choice_is_refused(world_tokenizer):
    model = build_tiny_model(TinyModelSpec(), world_tokenizer, seed=0)
    assert build_engine(EngineConfig(), model, world_tokenizer).decode == "fused"
    with pytest.raises(ValueError, match="engine.hf_decode must be one of auto, forward, fused, fused_compiled, generate_compiled"):
        build_engine(EngineConfig(hf_decode="compiled"), model, world_tokenizer)


def test_a_parser_message_without_a_replaced_key_gets_no_note():
    assert replaced_key_note("Group 'model' does not accept option 'engine.hf_decodes'") == ""
    assert "engine.hf_compile was" not in replaced_key_note("unrecognized arguments: --model.engine.hf_compile_mode x")


def run_cli(tmp_path, capsys, *args):
    with mock.patch.object(sys, "argv", ["r3l"]), pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", *args])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("key, value", [("hf_compile", "on"), ("hf_compile_mode", "default"), ("hf_fused_decode", "false"), ("hf_fused_compile", "true")])
def test_a_replaced_key_in_a_config_file_is_refused_naming_hf_decode(tmp_path, capsys, key, value):
    config = tmp_path / "engine.yaml"
    config.write_text(f"model:\n  engine:\n    {key}: {value}\n")
    code, err = run_cli(tmp_path, capsys, "--config", str(config))
    assert code == 2 and "Traceback" not in err
    assert f"engine.{key} was replaced by {REPLACED_KEYS[key]}" in err


@pytest.mark.parametrize("args", [["--model.engine.hf_compile", "on"], ["--model.engine.hf_fused_compile=true"]])
def test_a_replaced_key_on_the_command_line_is_refused_naming_hf_decode(tmp_path, capsys, args):
    code, err = run_cli(tmp_path, capsys, *args)
    key = args[0].split("=")[0].removeprefix("--model.engine.")
    assert code == 2 and f"engine.{key} was replaced by engine.hf_decode" in err


def test_vllm_max_model_len_is_the_runs_budget_capped_at_the_models_limit():
    from types import SimpleNamespace

    from r3lightning.engines.config import vllm_max_model_len

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    assert vllm_max_model_len(0, 216, model) == 216  # the run's budget, not the model's 8,192
    assert vllm_max_model_len(0, 10_000, model) == 8192
    assert vllm_max_model_len(512, 216, model) == 512  # a configured value wins
    assert vllm_max_model_len(0, 0, model) == 0  # nothing known: vLLM takes the model's maximum


def test_the_runs_context_budget_covers_episodes_reflections_and_generations():
    from r3lightning.data.datamodule import RolloutDataModule
    from r3lightning.engines.base import SamplingParams
    from r3lightning.envs.math_env import MathSuite
    from r3lightning.rollout.agent_loop import AgentLoopConfig
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

    suite = MathSuite(num_val_tasks=2)
    plain = RolloutDataModule(suite, sampling=SamplingParams(max_new_tokens=24), agent=AgentLoopConfig(max_context_tokens=96))
    assert plain.context_budget() == 2 * 96 + 24
    reflecting = RolloutDataModule(
        suite, explorer=ReflectRetryExplorer(max_reflection_tokens=48),
        sampling=SamplingParams(max_new_tokens=24), agent=AgentLoopConfig(max_context_tokens=96),
    )
    assert reflecting.context_budget() == 2 * 96 + 48
