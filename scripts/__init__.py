"""Developer tools: the install (``setup.sh``), whether a change moves any logged number
(``refactor_equivalence``, ``commit_equivalence``), git worktrees of other commits, a GPU session's
checks (``gpu_session.sh``). Run from the repository root: ``python -m scripts.<name> --help``."""
