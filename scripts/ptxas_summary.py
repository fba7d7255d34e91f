#!/usr/bin/env python3
"""Registers and spills per CUDA kernel and arch, from build logs with ptxas -v output.

    cmake --build build 2>&1 | tee build/build.log   # configured with -DROPESCALE_PTXAS_VERBOSE=ON
    python scripts/ptxas_summary.py build/build.log

One line per (kernel, arch), names demangled with c++filt when it is on the PATH. Exits 1 when a
kernel spills, so CI can flag it; prints nothing (exit 0) when the logs have no ptxas output (nothing
was recompiled, or a CPU-only build), except with --require (ctest's ptxas tests), where a missing
log or one with no kernel is a failure (exit 2): a check that saw no kernel checked nothing. With
--archs 80,90 (ctest's ptxas_no_spills, over the reports a development build keeps per CUDA object in
build/ptxas/), every log must hold kernels for each of those archs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def parse(lines):
    """{(mangled kernel, arch): dict(registers, stack, spill_stores, spill_loads)}"""
    kernels = {}
    entry = arch = properties_of = None
    for line in lines:
        if m := ENTRY.search(line):
            entry, arch = m.groups()
            kernels.setdefault((entry, arch), {})
        elif m := PROPERTIES.search(line):
            properties_of = m.group(1)
        elif (m := FRAME.search(line)) and entry and properties_of == entry:
            kernels[(entry, arch)].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif (m := USED.search(line)) and entry:
            kernels[(entry, arch)]["registers"] = int(m[1])
    return kernels


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=False).stdout
    return dict(zip(names, out.splitlines())) if out else {n: n for n in names}


def main(paths: list[str], require: bool = False, archs: tuple[str, ...] = ()) -> int:
    kernels = {}
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                found = parse(f)
        except FileNotFoundError:
            if not require:
                continue
            print(f"{path}: no such ptxas report (was the object compiled by this build?)", file=sys.stderr)
            return 2
        missing = [arch for arch in archs if not any(a == f"sm_{arch}" for _, a in found)]
        if require and (not found or missing):
            what = f"no kernel for sm_{', sm_'.join(missing)}" if found else "no ptxas -v output"
            print(f"{path}: {what}: nothing was checked there", file=sys.stderr)
            return 2
        kernels.update(found)
    if not kernels:
        return 0
    names = demangle(sorted({k for k, _ in kernels}))
    spilling = 0
    print(f"{'arch':<6} {'regs':>4} {'stack':>5} {'spill st/ld':>11}  kernel")
    for (kernel, arch), info in sorted(kernels.items(), key=lambda item: (names[item[0][0]], item[0][1])):
        stores, loads = info.get("spill_stores", 0), info.get("spill_loads", 0)
        spilling += bool(stores or loads)
        print(f"{arch:<6} {info.get('registers', -1):>4} {info.get('stack', 0):>5} {f'{stores}/{loads}':>11}  "
              f"{names[kernel].removeprefix('void ')}")
    print(f"{len(kernels)} kernel builds, {spilling} with spills")
    return 1 if spilling else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", default=["build/build.log"], help="build logs or ptxas reports")
    parser.add_argument("--require", action="store_true", help="a missing log or one with no kernel fails (exit 2)")
    parser.add_argument("--archs", default="", help="comma-separated SM versions every log must hold kernels for")
    options = parser.parse_args()
    sys.exit(main(options.logs, options.require, tuple(a for a in options.archs.split(",") if a)))
