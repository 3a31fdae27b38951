"""The chaos soak: random faults in combinations, judged by an independent checker.

This project's own harness, not shipped with the package: it needs root (network
namespaces), PostgreSQL and Redis. :mod:`.soak` runs the cluster, the candidates
(:mod:`.soak_child`), workers and beat, and injects faults; :mod:`.checker` judges
the run from the events alone; :mod:`.netns` makes a second "host" on this machine.
Run it with ``benchmarks/soak.py`` (the repository root must be importable).
"""
