"""Benchmark suite of asyncsample: throughput against the peers, overhead, lag and memory.

Run it with ``python -m benchmarks`` (or ``asyncsample bench``); see ``python -m benchmarks -h``.
"""

from __future__ import annotations

__all__: list[str] = []
