#!/usr/bin/env python
"""Throughput benchmark: pagedinfer vs transformers ``generate`` and ``generate_batch``.

A thin wrapper around `pagedinfer.bench` (see its docstring and ``docs/bench.md``)::

    python scripts/bench_throughput.py --quick
    python scripts/bench_throughput.py --workloads W0,W1 --json bench.json
"""

import sys

from pagedinfer.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
