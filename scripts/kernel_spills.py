"""Which functions of the CPU kernels multiply-add with a stack operand: a sum the compiler kept in memory instead of
a register (a load and a store around every multiply-add of it, and a chain through memory).

Compiles each kernel exactly as ``kernels_pallas/cpu_build.py`` builds it, but to assembly, and counts per function
the vector multiply-adds (``vfmadd*``) that read or write ``(%rsp)`` / ``(%rbp)``. A register tile with more sums
and weights than the CPU has vector registers (32 with AVX-512) must spill some; a tile that fits should show none.
``PanelTileCompact`` once kept every sum in memory (2026-12-03: 2-8-row products from 4-bit panels 1.2-1.6x slower;
kernels_pallas/linear/cpu_kernel.cc says how it was fixed).

    python scripts/kernel_spills.py                  # every kernel, functions with any such multiply-add
    python scripts/kernel_spills.py --kernel linear --all
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nightjar_jax.bench.common import make_parent, writable_out  # noqa: E402

KERNELS = ("linear", "paged_attention", "sampling")
LABEL = re.compile(r"^(_Z\S+):$")
FMA = re.compile(r"\b(vfn?m(add|sub)\w*ps|vpdpbu?sd)\b")  # float multiply-adds; VNNI int8 dot products


def spills(assembly: str) -> list[tuple[str, int, int]]:
    """``(function, multiply-adds, of them with a stack operand)`` per function of the assembly, mangled names."""
    out, name, fmas, stack = [], None, 0, 0
    for line in assembly.splitlines():
        m = LABEL.match(line)
        if m:
            if name is not None:
                out.append((name, fmas, stack))
            name, fmas, stack = m.group(1), 0, 0
        elif name is not None and FMA.search(line):
            fmas += 1
            stack += "(%rsp)" in line or "(%rbp)" in line
    if name is not None:
        out.append((name, fmas, stack))
    return out


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    text = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False).stdout
    got = text.splitlines()
    return got if len(got) == len(names) else names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=KERNELS, action="append", help="kernel folder (default: all)")
    ap.add_argument("--all", action="store_true", help="list every function with multiply-adds, not only spilling ones")
    ap.add_argument("--out", type=writable_out, help="also write the table as JSON here")
    args = ap.parse_args()
    rows = []
    for kernel in args.kernel or KERNELS:
        library = importlib.import_module(f"kernels_pallas.{kernel}.cpu")._LIBRARY
        found = [r for r in spills(library.assembly()) if r[1] and (args.all or r[2])]
        for (_, fmas, stack), name in zip(found, demangle([r[0] for r in found]), strict=True):
            rows.append({"kernel": kernel, "function": name, "fma": fmas, "fma_with_stack_operand": stack})
    rows.sort(key=lambda r: (-r["fma_with_stack_operand"], r["kernel"], r["function"]))
    print("| kernel | multiply-adds | with a stack operand | function |\n|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['fma']} | {r['fma_with_stack_operand']} | `{r['function'][:120]}` |")
    if not rows:
        print("(none)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(make_parent(args.out)).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
