"""benchmarks/quickstart_decode.py: each compiled run is divided by the fused run of its own repeat."""

from benchmarks.quickstart_decode import ratios


def record(repeat: int, run: str, wall: float, rollout: float) -> dict:
    return {"repeat": repeat, "run": run, "wall_s": wall, "rl_rollout_s_total": rollout}


def test_compiled_runs_are_divided_by_the_fused_run_of_their_own_repeat():
    runs = [
        record(0, "compiled_cold", 300.0, 30.0), record(0, "fused", 200.0, 40.0), record(0, "compiled_warm", 220.0, 20.0),
        record(1, "compiled_cold", 330.0, 33.0), record(1, "fused", 300.0, 30.0), record(1, "compiled_warm", 240.0, 27.0),
    ]
    figures = ratios(runs)
    assert figures["compiled_cold_over_fused_wall_per_repeat"] == [1.5, 1.1]
    assert figures["compiled_warm_over_fused_wall_per_repeat"] == [1.1, 0.8]
    assert figures["compiled_warm_over_fused_rl_rollout_per_repeat"] == [0.5, 0.9]
    assert figures["compiled_cold_over_fused_wall_median"] == 1.3
    assert figures["compiled_warm_over_fused_rl_rollout_median"] == 0.7
