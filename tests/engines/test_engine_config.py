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
