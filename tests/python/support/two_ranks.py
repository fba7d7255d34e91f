"""The one runner of checks on two spawned ranks (tests/python/ops/test_distributed.py, adapters/
test_context_parallel.py): each test module declares ``CHECKS = {name: check(mesh, rank)}``; :func:`run` spawns two
processes (spawned, not forked: a fork of a pytest process in which an earlier test ran autograd cannot run autograd
itself), each imports that module again, joins the process group and runs the named checks in order, writing each
outcome (its error, what it returned, its seconds) to a file as it ends; checks run in the same order on both ranks,
so a failing one fails alike on both.

A rank ends with ``os._exit(0)`` once its outcomes are written and the process group is destroyed: gloo's threads at
interpreter teardown aborted a rank once in CI ("terminate called without an active exception", SIGABRT) after its
checks had run. A rank that dies before any check starts (joining the group) is started again once, with both
ranks' stderr kept; a rank that dies while a check runs fails the test with that check named."""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
import warnings
from datetime import timedelta

WORLD = 2


def _rank(rank, module_name, device, init_file, out_dir, names):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    checks = importlib.import_module(module_name).CHECKS
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh(device, (WORLD,))
        results = {}
        for name in names:
            start = time.perf_counter()
            try:
                results[name] = {"error": None, "figures": checks[name](mesh, rank)}
            except BaseException:  # noqa: B036  (reported to the test, which fails with it)
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = round(time.perf_counter() - start, 2)
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # the outcomes are on disk: nothing of interpreter teardown may turn them into a crash


def _outcomes(out_dir) -> dict:
    """{check: [outcome per rank that wrote one]} from the ranks' files (absent: that rank wrote nothing)."""
    outcomes = {}
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                for name, outcome in json.load(f).items():
                    outcomes.setdefault(name, []).append(outcome)
    return outcomes


def _attempt(out_dir: str, module_name: str, names, device: str, timeout: float):
    import torch.multiprocessing as mp

    os.makedirs(out_dir, exist_ok=True)
    context = mp.start_processes(_rank, args=(module_name, device, os.path.join(out_dir, "store"), out_dir,
                                              list(names)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish in {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def run(tmp_path, module_name: str, names, device: str = "cpu", timeout: float = 300) -> dict:
    """Runs the named checks of ``module_name``'s ``CHECKS`` on two spawned ranks; {check: [rank 0's outcome,
    rank 1's]}. A crash before any check ran is retried once; one after every check ran on both is a warning; one in
    between is raised with the checks done."""
    from torch.multiprocessing import ProcessExitedException

    for attempt in range(2):
        out_dir = str(tmp_path / f"attempt{attempt}")
        try:
            _attempt(out_dir, module_name, names, device, timeout)
        except ProcessExitedException as err:
            done = _outcomes(out_dir)
            if all(len(done.get(name, ())) == WORLD for name in names):
                warnings.warn(f"two_ranks: a rank died after every check had run on both ranks ({err})")
                return done
            if not done and attempt == 0:
                warnings.warn(f"two_ranks: a rank died before any check ran ({err}); starting both again")
                continue
            lacking = [name for name in names if len(done.get(name, ())) < WORLD]
            raise AssertionError(f"a rank died ({err}) in check {lacking[0]!r}, the first that not every rank "
                                 f"finished (finished on both: {[n for n in names if n not in lacking]})") from err
        return _outcomes(out_dir)
    raise AssertionError("unreachable")


def assert_passed(outcomes: dict, name: str):
    """The check ran on both ranks without an error; what it returned on rank 0."""
    assert name in outcomes and len(outcomes[name]) == WORLD, f"{name} did not run on every rank: {outcomes}"
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes[name]) if o["error"]]
    assert not errors, "\n".join(errors)
    return outcomes[name][0].get("figures")
