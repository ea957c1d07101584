"""``HuggingFaceExport``: the live policy, exported during and at the end of fit, loads with
``AutoModelForCausalLM`` and gives the policy's exact logits; the run's own policy is left as it was."""

import pytest
import torch
from digit_suite import DigitSuite
from harness import TINY_SPEC, module_and_data, quiet_trainer
from transformers import AutoModelForCausalLM

from r3lightning.callbacks import HuggingFaceExport
from r3lightning.training.models import ModelConfig
from r3lightning.rollout.agent_loop import AgentLoopConfig

TEXTS = ["Say a number above 3.", "4"]


@torch.no_grad()
def logits(model, tokenizer):
    return [model(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits for t in TEXTS]


@pytest.mark.parametrize("model", [ModelConfig(tiny=TINY_SPEC), ModelConfig(tiny=TINY_SPEC, lora_rank=4, lora_alpha=8)],
                         ids=["full", "lora"])
def test_exports_every_n_steps_and_at_the_end(tmp_path, model):
    module, dm = module_and_data(DigitSuite(), group_size=2, agent=AgentLoopConfig(action_format="raw"), model=model)
    exporter = HuggingFaceExport(dirpath=str(tmp_path / "hf"), every_n_train_steps=2)
    trainer = quiet_trainer(3, callbacks=[exporter])
    trainer.fit(module, dm)
    assert exporter.exported == [str(tmp_path / "hf" / "step2"), str(tmp_path / "hf" / "final")]
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "final").eval()
    step2 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step2").eval()
    policy = module.policy.eval()
    for got, expected in zip(logits(final, module.tokenizer), logits(policy, module.tokenizer)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # Step 3 trained on after the step-2 export.
    assert not torch.allclose(logits(step2, module.tokenizer)[0], logits(final, module.tokenizer)[0], atol=1e-6)
    if model.lora_rank > 0:  # the run's policy keeps its adapters: merging acted on a copy
        assert any("lora_" in name for name, _ in module.policy.named_parameters())


def test_refuses_what_it_cannot_export(tmp_path):
    module, dm = module_and_data(DigitSuite(), group_size=2, agent=AgentLoopConfig(action_format="raw"))
    with pytest.raises(ValueError, match="no LoRA adapter"):
        quiet_trainer(1, callbacks=[HuggingFaceExport(dirpath=str(tmp_path), lora="adapter")]).fit(module, dm)
    with pytest.raises(ValueError, match="every_n_train_steps"):
        HuggingFaceExport(every_n_train_steps=-1)


def test_an_unwritable_directory_is_found_at_setup_naming_the_callback(tmp_path):
    module, dm = module_and_data(DigitSuite(), group_size=2, agent=AgentLoopConfig(action_format="raw"))
    (tmp_path / "file").write_text("not a directory")
    trainer = quiet_trainer(2, callbacks=[HuggingFaceExport(dirpath=str(tmp_path / "file" / "hf"))])
    with pytest.raises(OSError, match=r"HuggingFaceExport: dirpath '.*/file/hf' is not writable: '.*/file' is a file, not a directory"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0


def test_a_full_disk_at_export_names_the_callback_and_leaves_nothing(tmp_path, monkeypatch):
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    module, dm = module_and_data(DigitSuite(), group_size=2, agent=AgentLoopConfig(action_format="raw"))
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    final = tmp_path / "hf" / "final"
    with pytest.raises(OSError, match=rf"HuggingFaceExport: writing '{final}' failed: No space left on device \(the weights alone need about .* free in .*\); nothing was left there"):
        quiet_trainer(1, callbacks=[HuggingFaceExport(dirpath=str(tmp_path / "hf"))]).fit(module, dm)
    assert list((tmp_path / "hf").iterdir()) == []
