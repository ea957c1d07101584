"""The ``machine`` section every benchmark JSON carries (docs/design.md, "Benchmarks")."""

from __future__ import annotations

import hashlib
import os
import platform
from typing import Callable

import torch

# (rows, inner, columns) of the matmuls a tiny policy's step is made of: decoding rows against the
# fused query/key/value and LM-head weights, a training batch's flattened tokens, a weight gradient
# summed over those tokens (where threads may split the sum), a tall-skinny one.
PROBE_SHAPES = ((64, 256, 768), (64, 256, 860), (2112, 256, 256), (256, 2112, 256), (512, 1024, 64))


def policy_like_probe(generator: torch.Generator) -> list[torch.Tensor]:
    """float32 matmuls at ``PROBE_SHAPES`` and a log-softmax over the widest: the kernels (BLAS and
    ATen's vectorized reductions) whose summation order decides a seeded run's rounding."""
    outputs = []
    for rows, inner, columns in PROBE_SHAPES:
        a = torch.randn(rows, inner, generator=generator)
        b = torch.randn(inner, columns, generator=generator)
        outputs.append(a @ b)
    outputs.append(torch.log_softmax(outputs[1], dim=-1))
    return outputs


def numerics_fingerprint(threads: int, probe: Callable[[torch.Generator], list[torch.Tensor]] = policy_like_probe) -> str:
    """16 hex digits hashing the exact bits ``probe`` computes from fixed inputs at ``threads`` torch
    threads (the caller's thread count is restored).

    Where two machines' fingerprints at a run's thread count differ, a seeded run's rounding differs
    from its first step and its curves drift apart after a hundred or so steps, though the CPU's name,
    torch build and config are the same. Equal fingerprints are necessary for equal runs, not
    sufficient: kernels outside the probe may still sum differently.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = probe(torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(before)
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _cpuinfo_fields() -> dict:
    """Model name, family / model / stepping (the name alone, e.g. "AMD EPYC", hides the generation)
    and the wide-vector instruction sets present, from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line]
    except OSError:
        return {}
    fields = {key.strip(): value.strip() for key, value in lines}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", ""),
        "cpu_family_model_stepping": "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cpu_vector_flags": sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}),
    }


def machine_info() -> dict:
    """Platform, CPU, torch build and threads, the load average when the run ended (figures measured
    on a busy machine are only comparable as ratios), and the numerics fingerprint at 1 thread and at
    the process's thread count (runs are comparable number for number only where it is equal)."""
    threads = torch.get_num_threads()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        **_cpuinfo_fields(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "numerics_fingerprint": {str(n): numerics_fingerprint(n) for n in sorted({1, threads})},
    }
