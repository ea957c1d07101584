"""Inductor's compiled artefacts are kept on disk across runs (engines/compile_cache.py): a second
process compiling the same step loads them (a cache hit, no miss); a model of another shape compiles
anew (a miss). The cache directory resolves from the setting, then $TORCHINDUCTOR_CACHE_DIR, then a
directory under the user's cache home, which survives reboots (torch's default sits in /tmp)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from r3lightning.engines.compile_cache import compile_cache_dir

ROOT = Path(__file__).resolve().parents[2]


def test_the_setting_wins_then_the_environment_then_the_user_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache_dir("") == str(tmp_path / "xdg" / "r3lightning" / "torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache_dir("") == str(tmp_path / "env")
    assert compile_cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")


def _probe(cache_dir: Path, layers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "engines" / "compile_cache_probe.py"), str(cache_dir), str(layers)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_run_loads_the_compiled_step_and_another_shape_compiles_anew(tmp_path):
    cache = tmp_path / "inductor"
    first = _probe(cache, layers=1)
    assert first["perf/compile_cache_misses"] >= 1 and first["perf/compile_cache_hits"] == 0
    assert any(cache.iterdir())  # the artefacts are in the directory asked for
    second = _probe(cache, layers=1)
    assert second["perf/compile_cache_hits"] >= 1 and second["perf/compile_cache_misses"] == 0
    other_shape = _probe(cache, layers=2)
    assert other_shape["perf/compile_cache_misses"] >= 1
