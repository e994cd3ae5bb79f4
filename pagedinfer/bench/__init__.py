"""`pagedinfer bench`: pagedinfer against transformers on the same prompts and model, in one run.

workloads.py (what is run), models.py (the random-weight model shapes), job.py (what crosses into
each system's subprocess: `Job`, `RunResult`, the `System` protocol), pagedinfer_system.py and
hf_systems.py (the systems), systems.py (the registry and the subprocess calls), runner.py
(`BenchOptions`, `run_bench`), machine.py (CPU, GEMM rates, RSS), report.py (tables and ratios).
Method and results: docs/bench.md.
"""
