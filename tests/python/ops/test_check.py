"""`ropescale check`: every op on every device of this machine against float64 references, one table,
a non-zero exit with what to report when a kernel is wrong (planted here), and the same with
ROPESCALE_KERNELS=reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale.reference import ROUTED_OPS

PACKAGE_PARENT = str(Path(ropescale.__file__).parents[1])


def run_check(*args, extra_path: str | None = None, **env) -> tuple[subprocess.CompletedProcess, float]:
    environment = {**os.environ, **env}
    environment.pop("ATEN_CPU_CAPABILITY", None)  # the check forces each variant itself
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, PACKAGE_PARENT]))
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ropescale", "check", *args], capture_output=True, text=True,
                            env=environment, timeout=600)
    return result, time.monotonic() - start


def expected_variants() -> set[str]:
    """The CPU variants the check must cover on this CPU (as the rotary ISA test picks them)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {"DEFAULT"}
    return {"DEFAULT"} | {isa.upper() for isa in ("avx2", "avx512") if getattr(torch.cpu, f"_is_{isa}_supported")()}


def table_rows(output: str) -> list[list[str]]:
    """The table's rows, split on runs of 2+ spaces: op, device, dtype, shape, error, allowed, ms, verdict."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op ")) + 2
    end = next(i for i in range(start, len(lines)) if re.match(r"\d+ of \d+ results", lines[i]))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end] if not line.startswith("note:")]


def assert_covers_every_op(rows: list[list[str]]) -> None:
    seen = {(row[0].split(" (")[0], row[1].split()[-1], row[2]) for row in rows}
    for variant in expected_variants():
        for op in ROUTED_OPS:
            for dtype in ("float32", "float16", "bfloat16"):
                assert (op, variant, dtype) in seen, f"no row for {op} {dtype} on cpu {variant}"


def test_check_passes_on_this_cpu_within_a_minute():
    result, seconds = run_check("--devices", "cpu")
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernels: native" in result.stdout
    rows = table_rows(result.stdout)
    assert_covers_every_op(rows)
    assert all(row[-1] == "ok" for row in rows), [row for row in rows if row[-1] != "ok"]
    assert "FAILED" not in result.stdout
    assert seconds < 60, f"ropescale check took {seconds:.0f} s"


# Loaded at the start of every Python process of the check (the command and each device run): a
# wrong apply_rotary_pos_qk kernel on the CPU (it forgets to rotate), and, in the DEFAULT variant's
# process only, a rerope_attention kernel that aborts the process.
_PLANTED = """
import os
import torch
import ropescale

def wrong_apply_rotary_pos_qk(q, k, positions, inv_freq, scale=1.0, interleaved=False, *, conjugate=False):
    return q.clone(), k.clone()

def crashing_rerope_attention(*args):
    os.abort()

_library = torch.library.Library("ropescale", "IMPL")
_library.impl("apply_rotary_pos_qk", wrong_apply_rotary_pos_qk, "CPU")
if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
    _library.impl("rerope_attention", crashing_rerope_attention, "CPU")
"""


def test_a_wrong_kernel_fails_the_check_and_says_what_to_report(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(_PLANTED))
    result, _ = run_check("--devices", "cpu", extra_path=str(tmp_path))
    print(result.stdout, result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table_rows(result.stdout)
    failing = {(row[0], row[1]) for row in rows if row[-1] != "ok"}
    ops_failing = {op for op, _ in failing}
    assert ops_failing == {"apply_rotary_pos_qk", "(the check itself)"}, failing
    # Every variant's wrong op is caught, in every dtype; nothing else fails.
    for variant in expected_variants():
        assert sum(1 for row in rows if row[0] == "apply_rotary_pos_qk" and row[1].endswith(variant)
                   and row[-1].startswith("FAIL")) == 3
    crash = next(row for row in rows if row[0] == "(the check itself)")
    assert "died of signal 6" in crash[-1], crash
    # The report: what failed, the way around it, what to send.
    assert re.search(r"^FAILED: \d+ result\(s\) outside their bounds: \(the check itself\), apply_rotary_pos_qk\.$",
                     result.stdout, re.M), result.stdout
    assert "ROPESCALE_KERNELS=reference" in result.stdout
    assert f"ropescale.build_info(): {ropescale.build_info()}" in result.stdout
    assert f"torch {torch.__version__}" in result.stdout
    assert "the failing rows:" in result.stdout


def test_reference_kernels_pass_and_the_table_says_so():
    result, seconds = run_check("--devices", "cpu", ROPESCALE_KERNELS="reference")
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernels: reference (ROPESCALE_KERNELS=reference" in result.stdout
    rows = table_rows(result.stdout)
    assert_covers_every_op(rows)
    assert all(row[-1] == "ok" for row in rows)


def test_json_output_and_help():
    import json

    from ropescale import check, cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", "--help"])
    assert exit_info.value.code == 0
    assert "ROPESCALE_KERNELS=reference" in check.DESCRIPTION and "float64 reference" in check.DESCRIPTION
    result, _ = run_check("--devices", "cuda", "--json")
    report = json.loads(result.stdout)
    assert report["build_info"] == ropescale.build_info() and report["torch"] == torch.__version__
    if torch.cuda.is_available():
        assert result.returncode == 0 and report["ok"] and report["rows"], result.stdout
    else:  # nothing to check: said so, and not a pass
        assert result.returncode == 1 and not report["ok"] and report["notes"] == [
            "no CUDA GPU here (torch.cuda.is_available() is False)"]


def test_the_cuda_only_attention_cases_run_and_pass_on_this_cpu():
    """The problems `ropescale check` adds on a GPU (a batch of one at the tensor-core shape, head dim 256),
    built and judged on CPU tensors, two rows (out, lse) per case and dtype, all within bounds: on an H200
    their construction raised IndexError before any kernel ran (row 1's left padding on a batch of one)."""
    from ropescale import check

    cpu_cases = check._attention_cases(cuda=False)
    cuda_only = [case for case in check._attention_cases(cuda=True) if case not in cpu_cases]
    assert cuda_only and all(case[1] == 1 for case in cuda_only)
    rows = check._attention_rows(torch.device("cpu"), "cpu", cuda_only)
    assert len(rows) == 2 * sum(len(case[13]) for case in cuda_only)
    assert all(row.ok for row in rows), [row for row in rows if not row.ok]


def test_sdpa_refusing_a_forced_capability_falls_back_to_its_math_backend(monkeypatch):
    """On an H200 host (AMX), the workers with ATEN_CPU_CAPABILITY=default and avx2 died on
    "pack_vnni2 is only supported when avx512 is supported", most likely from torch 2.11's CPU flash
    attention (ropescale packs only in its AVX-512 variant; no traceback was kept). When SDPA refuses,
    SDPA's own error (the bound of every attention row) comes from its math backend, and the rows are
    still judged."""
    from ropescale import check

    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    refused = []

    def flash_refusing_sdpa(*args, **kwargs):
        if torch.backends.cuda.flash_sdp_enabled():  # sdpa_kernel(SDPBackend.MATH) turns it off
            refused.append(True)
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(check.F, "scaled_dot_product_attention", flash_refusing_sdpa)
    rows = check._attention_rows(torch.device("cpu"), "cpu")
    assert refused and rows and all(row.ok for row in rows), [row for row in rows if not row.ok]
