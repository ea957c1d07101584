"""Every file the user hands in is checked where it enters (docs/reliability.md, "Files handed in"):
checkpoints (``--ckpt_path`` of fit and validate, ``r3l export``), model directories and tokenizers,
and ``hf:`` sources while offline. Each ends in one ``r3l: error:`` line naming the file and what is
wrong, exit status 1."""

import os
import shutil
import struct
import sys
import zipfile
from unittest import mock

import pytest
import torch
from harness import TINY_SPEC, module_and_data, quiet_trainer

from r3lightning.checkpointing.read import read_checkpoint
from r3lightning.cli.main import main
from r3lightning.training.models import ModelConfig, build_tiny_model, build_tokenizer, load_pretrained


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    module, dm = module_and_data()
    trainer = quiet_trainer(1)
    trainer.fit(module, dm)
    path = tmp_path_factory.mktemp("ckpt") / "good.ckpt"
    trainer.save_checkpoint(path)
    return path


def flip_inside_a_tensor(data: bytes, path) -> bytes:
    """``data`` with one byte flipped in the middle of the checkpoint's largest tensor."""
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
    name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26 : member.header_offset + 30])
    at = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


CORRUPTIONS = {
    "missing": (None, "no such file"),
    "empty": (lambda data, path: b"", r"is empty \(0 bytes"),
    "truncated": (lambda data, path: data[: len(data) // 2], "not a zip archive"),
    "text": (lambda data, path: b"epoch: 3\nweights: somewhere\n", "not a zip archive"),
    "byte-flipped": (flip_inside_a_tensor, "fails its CRC-32 check"),
}


def corrupt(good, tmp_path, kind):
    path = tmp_path / f"{kind}.ckpt"
    change, message = CORRUPTIONS[kind]
    if change is not None:
        path.write_bytes(change(good.read_bytes(), good))
    return str(path), message


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_checkpoints_are_named_with_what_is_wrong(good_checkpoint, tmp_path, kind):
    path, message = corrupt(good_checkpoint, tmp_path, kind)
    with pytest.raises(ValueError, match=rf"checkpoint '{path}'.*{message}"):
        read_checkpoint(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ([1, 2, 3], "holds a list, not a dict"),
        ({"state_dict": {"w": torch.zeros(1)}, "epoch": 0}, "no 'hyper_parameters', 'r3lightning' section"),
        ({"state_dict": {}, "hyper_parameters": {"model": {}}, "r3lightning": {}}, "'r3lightning' section has no tokenizer_fingerprint"),
        ({"state_dict": {}, "hyper_parameters": {}, "r3lightning": {"tokenizer_fingerprint": "x"}}, "hyper_parameters have no 'model'"),
    ],
    ids=["not-a-dict", "foreign", "empty-section", "no-model-config"],
)
def test_torch_files_without_an_r3lightning_checkpoint_inside(tmp_path, content, message):
    path = tmp_path / "other.ckpt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=rf"checkpoint '{path}'.*{message}"):
        read_checkpoint(str(path))


def test_a_sound_checkpoint_reads(good_checkpoint):
    assert read_checkpoint(str(good_checkpoint))["global_step"] == 1


def r3l(capsys, *args):
    with mock.patch.object(sys, "argv", ["r3l"]), pytest.raises(SystemExit) as stop:
        main(list(args))
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["fit", "validate", "export"])
def test_the_cli_names_a_damaged_checkpoint_in_one_line(good_checkpoint, tmp_path, capsys, command):
    path, _ = corrupt(good_checkpoint, tmp_path, "truncated")
    if command == "export":
        code, err = r3l(capsys, "export", "--ckpt_path", path, "--out", str(tmp_path / "out"))
        assert err.strip() == f"r3l export: error: checkpoint {path!r} is not a PyTorch checkpoint: not a zip archive " \
                              f"({os.path.getsize(path)} bytes; a truncated copy, or another kind of file)"
    else:
        code, err = r3l(capsys, command, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
                        "--data.suite=r3lightning.envs.math_env.MathSuite", "--ckpt_path", path)
        assert err.startswith(f"r3l: error: checkpoint {path!r} is not a PyTorch checkpoint: not a zip archive")
        assert len(err.strip().splitlines()) == 2 and "Traceback" not in err  # the message, and where it was raised
    assert code == 1


# ---- model directories and tokenizers ------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer(["What is 1+1?", "\\boxed{2}"] * 4, vocab_size=TINY_SPEC.vocab_size)
    path = tmp_path_factory.mktemp("model") / "good"
    build_tiny_model(TINY_SPEC, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def emptied(path):
    for name in os.listdir(path):
        os.remove(path / name)


def truncate(path, name):
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])


MODEL_DIR_FAULTS = {
    "empty": (emptied, "is an empty directory"),
    "no-config": (lambda p: os.remove(p / "config.json"), "not a Hugging Face model directory: no config.json"),
    "bad-config": (lambda p: (p / "config.json").write_text('{"model_type": '), r"config.json' is not valid JSON"),
    "no-weights": (lambda p: os.remove(p / "model.safetensors"), "has no weights"),
    "truncated-weights": (lambda p: truncate(p, "model.safetensors"), r"model.safetensors' is not a readable safetensors file \(truncated"),
    "no-tokenizer": (lambda p: [os.remove(p / n) for n in ("tokenizer.json",)], "has no tokenizer"),
    "corrupt-tokenizer": (lambda p: (p / "tokenizer.json").write_text('{"version": "1.0", "mod'), r"tokenizer.json' cannot be read as a tokenizer"),
}


@pytest.mark.parametrize("fault", list(MODEL_DIR_FAULTS))
def test_model_directories_are_checked_file_by_file(model_dir, tmp_path, fault):
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    damage, message = MODEL_DIR_FAULTS[fault]
    damage(path)
    with pytest.raises(ValueError, match=message) as error:
        load_pretrained(ModelConfig(name_or_path=str(path)))
    assert "sentencepiece" not in str(error.value) and "\n" not in str(error.value)


def test_an_empty_model_directory_through_the_cli(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    code, err = r3l(capsys, "fit", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=1",
                    f"--model.model.name_or_path={tmp_path / 'model'}", "--data.suite=r3lightning.envs.math_env.MathSuite")
    assert code == 1
    assert err.startswith(f"r3l: error: model.name_or_path: '{tmp_path / 'model'}' is an empty directory")
    assert "sentencepiece" not in err and "Traceback" not in err


# ---- hf: sources while offline -------------------------------------------------------------------
def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@pytest.mark.skipif(not offline(), reason="needs HF_HUB_OFFLINE=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize(
    "setting, message",
    [
        ("--data.suite.source=hf:r3lightning-test/missing", "could not load Hugging Face dataset 'r3lightning-test/missing'"),
        ("--model.model.name_or_path=r3lightning-test/missing", "model.name_or_path: cannot load 'r3lightning-test/missing'"),
    ],
    ids=["dataset", "model"],
)
def test_hub_sources_while_offline_are_one_line(tmp_path, capsys, setting, message):
    code, err = r3l(capsys, "fit", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=1",
                    "--data.suite=r3lightning.envs.math_env.MathSuite", setting)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("r3l: error: ") and message in lines[0], err
