#!/usr/bin/env python3
"""Registers and spills per CUDA kernel and arch, from a build log with ptxas -v output.

    cmake --build build 2>&1 | tee build/build.log   # configured with -DROPESCALE_PTXAS_VERBOSE=ON
    python scripts/ptxas_summary.py build/build.log

One line per (kernel, arch), names demangled with c++filt when it is on the PATH. Exits 1 when a
kernel spills, so CI can flag it; prints nothing (exit 0) when the log has no ptxas output (nothing
was recompiled, or a CPU-only build), except with --require (the ptxas_no_spills_sm* tests), where an
empty report is a failure (exit 2): a check that saw no kernel checked nothing.
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


def main(path: str, require: bool = False) -> int:
    with open(path, errors="replace") as f:
        kernels = parse(f)
    if not kernels:
        if require:
            print(f"{path}: no ptxas -v output: nothing was checked", file=sys.stderr)
            return 2
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
    args = sys.argv[1:]
    require = "--require" in args
    paths = [a for a in args if a != "--require"]
    sys.exit(main(paths[0] if paths else "build/build.log", require))
