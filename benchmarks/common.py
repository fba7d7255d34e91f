"""Shared timing helpers for the benchmarks: medians of repeated runs, synchronised on GPUs."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_name(device: str = "cpu") -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
