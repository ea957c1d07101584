"""A training policy's weights as checkpoint-named full tensors (no vLLM needed).

Used by the vLLM engine at start (``export_policy``) and by the ``VLLMWeightSync`` callback after each
optimizer step (``iter_weight_buckets``): LoRA merged without touching the trained module, tied
embeddings sent as ``lm_head.weight`` too, FSDP parameters gathered one FSDP unit (or, for
FSDP2/DTensor, one parameter) at a time, never all at once.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Iterator, Optional

import torch


_WRAPPER_PARTS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def _clean_name(name: str) -> str:
    """Strip FSDP / activation-checkpoint / torch.compile wrapper components from a parameter name."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _base_model(policy: torch.nn.Module) -> torch.nn.Module:
    return policy.get_base_model() if _is_peft(policy) else policy


def _tied_names(policy: torch.nn.Module) -> Optional[tuple[str, str]]:
    """(input-embedding weight name, LM-head weight name), policy-relative, when the two are tied."""
    base = _base_model(policy)
    config = getattr(base, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return None
    inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    if inp is None or out is None:
        return None
    names = {id(m): _checkpoint_name(_clean_name(n), _is_peft(policy)) for n, m in policy.named_modules()}
    if id(inp) not in names or id(out) not in names:
        return None
    return names[id(inp)] + ".weight", names[id(out)] + ".weight"


def _checkpoint_name(name: str, peft: bool) -> str:
    """Policy-relative parameter name -> Hugging Face checkpoint name (peft prefixes removed)."""
    if peft:
        name = re.sub(r"\.modules_to_save\.[^.]+(?=\.|$)", "", name)
        name = name.replace(".base_layer", "")
        if name.startswith("base_model.model."):
            name = name[len("base_model.model.") :]
    return name


def _lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency, but stay importable without it
        return None
    return LoraLayer


class _Namer:
    """Turns (policy-relative name, parameter) into checkpoint-named tensors, merging LoRA deltas."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.peft = _is_peft(policy)
        self.lora_type = _lora_layer_type() if self.peft else None
        self.modules = {_clean_name(n): m for n, m in policy.named_modules()} if self.peft else {}

    def __call__(self, name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if self.peft and (".lora_" in name or ".original_module." in name or "lora_magnitude_vector" in name):
            return  # adapter tensors (merged below) and the frozen copy of modules_to_save
        tensor = param.detach()
        if self.lora_type is not None and ".base_layer." in name and name.endswith(".weight"):
            owner = self.modules.get(name[: name.index(".base_layer.")])
            if isinstance(owner, self.lora_type) and not getattr(owner, "merged", False):
                for adapter in owner.active_adapters:
                    if adapter in owner.lora_A or adapter in getattr(owner, "lora_embedding_A", {}):
                        # A new tensor: the trained module is never modified.
                        tensor = tensor + owner.get_delta_weight(adapter).to(tensor.dtype)
        yield _checkpoint_name(name, self.peft), tensor


def _direct_parameters(module: torch.nn.Module, stop: type, prefix: str = "") -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Parameters of ``module`` outside nested instances of ``stop`` (their own FSDP units)."""
    for name, param in module.named_parameters(recurse=False):
        yield prefix + name, param
    for name, child in module.named_children():
        if not isinstance(child, stop):
            yield from _direct_parameters(child, stop, f"{prefix}{name}.")


def _fsdp1_gathered(policy: torch.nn.Module, root: torch.nn.Module, offload_to_cpu: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Full parameters of an FSDP1-sharded policy, one FSDP unit at a time (``summon_full_params``
    with ``recurse=False, writeback=False``): the extra memory is the largest unit, not the model.

    ``root`` is the outermost module holding the FSDP units (Lightning wraps the LightningModule, so
    parameters outside the policy's own units, e.g. embeddings, live in the root unit). Every rank
    must run this in the same order (each gather is a collective); each rank gets the full tensors
    of the current unit and feeds its own engine. Tensors are valid only until the next one is
    requested (the unit is resharded when the generator moves on), so consumers copy them.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    namer = _Namer(policy)
    policy_prefix = ""
    if root is not policy:
        policy_prefix = next((_clean_name(n) for n, m in root.named_modules() if m is policy), None)
        if policy_prefix is None:
            raise ValueError("iter_policy_weights: the policy is not inside fsdp_root")
    seen: set[str] = set()
    units = [(n, m) for n, m in root.named_modules() if isinstance(m, FSDP)]
    for unit_name, unit in units:
        unit_prefix = _clean_name(unit_name)
        with FSDP.summon_full_params(unit, recurse=False, writeback=False, offload_to_cpu=offload_to_cpu):
            for name, param in _direct_parameters(unit, FSDP):
                full = ".".join(p for p in (unit_prefix, _clean_name(name)) if p)
                if policy_prefix:
                    if not full.startswith(policy_prefix + "."):
                        continue
                    full = full[len(policy_prefix) + 1 :]
                if full in seen:
                    continue
                seen.add(full)
                for out_name, tensor in namer(full, param):
                    # The unit is resharded when the generator moves on: hand out a copy.
                    yield out_name, tensor.clone()


def _plain_named_parameters(policy: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Named full parameters of an unsharded policy (DTensors, e.g. FSDP2, gathered one by one)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = None  # type: ignore[assignment]
    namer = _Namer(policy)
    for name, param in policy.named_parameters():
        if DTensor is not None and isinstance(param, DTensor):
            # FSDP2 / tensor parallel: all-gather this one parameter (a collective on every rank).
            param = param.detach().full_tensor()
        yield from namer(_clean_name(name), param)


def iter_policy_weights(
    policy: torch.nn.Module,
    fsdp_root: Optional[torch.nn.Module] = None,
    offload_to_cpu: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights as ``(checkpoint name, tensor)`` pairs, streamed.

    - LoRA (peft): each ``base_layer.weight`` comes out as ``weight + B @ A * scale`` (a new tensor;
      adapters are not merged into, or otherwise changed in, the trained module); adapter tensors
      are not sent.
    - Tied input/output embeddings: the embedding is also sent as the LM head's weight (vLLM does
      not re-tie on reload).
    - FSDP (v1, ``FullyShardedDataParallel`` units anywhere in ``fsdp_root`` or the policy): gathered
      unit by unit with ``summon_full_params(unit, recurse=False, writeback=False)``; call on every
      rank. FSDP2 / DTensor parameters: gathered one parameter at a time with ``full_tensor()``.

    Names are those of the Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``),
    which is what vLLM's ``load_weights`` expects. Yielded tensors may share storage with the
    policy's parameters: consume them before the next optimizer step.
    """
    tied = _tied_names(policy)
    root = fsdp_root if fsdp_root is not None else policy
    fsdp = False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        fsdp = any(isinstance(m, FSDP) for m in root.modules())
    except ImportError:  # pragma: no cover
        pass
    items = _fsdp1_gathered(policy, root, offload_to_cpu) if fsdp else _plain_named_parameters(policy)
    sent_head = False
    for name, tensor in items:
        if tied is not None and name == tied[1]:
            sent_head = True
        yield name, tensor
        if tied is not None and name == tied[0] and not sent_head:
            sent_head = True
            yield tied[1], tensor


def iter_weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device | str | None = None,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``weights`` into lists of at most ``bucket_bytes`` (a tensor larger than that travels
    alone), each tensor moved to ``device`` / cast to ``dtype`` when given. Only one bucket is
    materialized at a time, so the extra memory of a sync is bounded by the bucket size (plus
    one FSDP unit while it is gathered)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        if device is not None or dtype is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def export_policy(policy: torch.nn.Module, tokenizer, directory: str) -> str:
    """Write the policy (LoRA merged), its config and tokenizer as a Hugging Face checkpoint that vLLM
    can load; returns ``directory``."""
    from safetensors.torch import save_file

    base = _base_model(policy)
    tied = _tied_names(policy)
    state = {}
    for name, tensor in iter_policy_weights(policy):
        if tied is not None and name == tied[1]:
            continue  # tied checkpoints store the embedding once
        state[name] = tensor.detach().to("cpu").contiguous()
    if any(t.is_meta for t in state.values()):
        raise ValueError("engine.backend=vllm: the policy's weights are on the meta device; set engine.model_path")
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
