"""What methods learn: comparisons of presets from one warm-start, the ReflectRL example and its
controls, analyses of runs. Run from the repository root: ``python -m experiments.<name> --help``;
results go to ``benchmarks/results/`` and are read in docs/results.md."""
