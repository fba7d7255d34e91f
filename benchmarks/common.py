"""Shared helpers for the benchmarks: medians of repeated runs (synchronised on GPUs), and the results file of a
long run that writes each cell as it ends and resumes from it."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


# SmolLM2-135M's training length and the long-context settings fixed from it (real_model.py's docstring says
# why), in one place for every benchmark that runs these methods.
TRAINED = 8192  # SmolLM2-135M's training length (max_position_embeddings)
WINDOW = TRAINED // 4  # the ReRoPE window (and Self-Extend's neighbour window)
DCA_CHUNK, DCA_LOCAL = 3 * TRAINED // 4, TRAINED // 16  # ChunkLlama's defaults for a model trained to L
STRING_RATIO, STRING_LOCAL = 0.33, 128  # STRING's authors' settings: S = 0.33 x the evaluated length, W = 128


def string_offset_for(length: int) -> int:
    """STRING's shifted offset S at ``length`` (its authors' RULER script: ``int(0.33 * test_max_length)``)."""
    return int(STRING_RATIO * length)


def leaky_k_for(length: int, window: int = WINDOW) -> float:
    """Leaky ReRoPE's k at ``length``: the longest distance lands on the trained length (1: plain RoPE)."""
    return max(1.0, (length - window) / (TRAINED - window))


def self_extend_group_for(length: int, window: int = WINDOW) -> int:
    """Self-Extend's smallest group whose extended length (TRAINED - window) G + window covers ``length``."""
    return max(1, math.ceil((length - window) / (TRAINED - window)))


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


def read_cells(path: Path, key: Callable[[dict], tuple], keep: Callable[[dict], bool] = lambda row: True) -> dict:
    """A resumable run's results file (one JSON object per line) by ``key(row)``, the rows ``keep`` accepts; a line
    cut short by an interrupted write is skipped (its cell is measured again)."""
    cells = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if keep(row):
                cells[key(row)] = row
    return cells


def append_cell(path: Path, row: dict) -> None:
    """``row`` as the last line of ``path`` (made with its folder), on a line of its own after one cut short."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if torn else "") + json.dumps(row) + "\n")
