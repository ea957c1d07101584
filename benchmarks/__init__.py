"""Speed measurements: rollout, agent-loop, training-update and whole-step throughput, the test suite's
time; every one writes a JSON with a ``machine`` section (``scripts.machine_info``) to
``benchmarks/results/``. Run from the repository root: ``python -m benchmarks.<name> --help``."""
