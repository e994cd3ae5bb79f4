#!/usr/bin/env python
"""Kept for old command lines: the benchmark is ``pagedinfer bench`` (pagedinfer/bench/, docs/bench.md).

python scripts/bench_throughput.py --quick      # the same as: pagedinfer bench --quick
"""

import sys

from pagedinfer.cli.app import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]], prog_name="pagedinfer")
