"""Where inductor keeps what it compiled, so that a later run loads it instead of compiling again.

Inductor caches on disk by itself (its FX-graph and AOT-autograd caches, with the generated C++), keyed
by the traced graph, the input shapes and strides, inductor's configuration, the torch version and the
CPU's instruction set: a change of shape or of the code that traces into the graph compiles anew.
Its default directory sits in the temporary directory (``/tmp/torchinductor_$USER``), which a reboot
or a fresh container empties; the engines point it at a directory under the user's cache home
instead, unless the user chose one.
"""

from __future__ import annotations

import os

ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir(setting: str) -> str:
    """The directory ``setting`` names; empty: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/r3lightning/torchinductor`` (``~/.cache/...`` without ``XDG_CACHE_HOME``)."""
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    if os.environ.get(ENV):
        return os.environ[ENV]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "r3lightning", "torchinductor")


def use_compile_cache(setting: str) -> str:
    """Point inductor at ``compile_cache_dir(setting)`` and return it. Inductor reads the variable when
    it first compiles and keeps it; a directory set after that takes effect once its in-process caches
    are cleared, which is done here when the directory changes."""
    directory = compile_cache_dir(setting)
    if os.environ.get(ENV) != directory:
        was_set = ENV in os.environ
        os.environ[ENV] = directory
        if was_set:
            from torch._inductor.utils import clear_caches

            clear_caches()
    return directory


def compile_cache_counts() -> dict[str, float]:
    """This process's lookups in inductor's on-disk FX-graph cache so far: hits (loaded) and misses
    (compiled and stored)."""
    from torch._dynamo.utils import counters

    return {
        "perf/compile_cache_hits": float(counters["inductor"]["fxgraph_cache_hit"]),
        "perf/compile_cache_misses": float(counters["inductor"]["fxgraph_cache_miss"]),
    }
