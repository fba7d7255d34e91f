"""What every engine plugin's entry point does first (``ropescale.vllm.register``, ``ropescale.sglang.register``):
once per process, its off switch, and the engine's version against the range the plugin was tested with."""

from __future__ import annotations

import importlib
import logging
import os


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; (0, 0) where it has none."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def engine_to_serve(state: dict, engine: str, module: str, switch: str, tested: tuple[tuple[int, int], ...],
                    logger: logging.Logger) -> str | None:
    """The engine's version when the plugin should go active in this process, else None (already registered, off
    through ``switch=0``, the engine not importable, or outside ``tested`` = ``(lower, upper)``: said once)."""
    if "done" in state:
        return None
    state["done"] = True
    if os.environ.get(switch, "1").strip() == "0":
        logger.info("ropescale: %s plugin off (%s=0)", engine, switch)
        return None
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return None
    version = getattr(imported, "__version__", "unknown")
    lower, upper = tested
    if not lower <= version_tuple(version) < upper:
        logger.warning(
            "ropescale: %s %s is outside the range this ropescale was tested with (>=%d.%d,<%d.%d): the plugin is NOT "
            "active; checkpoints with ropescale's rope types will be refused by %s", engine, version, *lower, *upper,
            engine)
        return None
    return version
