"""``scripts/kernel_spills.py``: a kernel compiled to assembly as it is built (``CpuKernelLibrary.assembly``), and
the count of multiply-adds with a stack operand per function."""

from __future__ import annotations

import shutil

import pytest

from nightjar_jax.testing import load_script

ASM = """\
_Z4tilePKf:
\tvfmadd231ps\t%zmm18, %zmm2, %zmm17
\tvfmadd213ps\t72(%rsp), %zmm11, %zmm18
\tvmovaps\t%zmm3, 200(%rsp)
.L3:
\tvfmadd132ps\t(%r10,%rcx,4){1to16}, %zmm20, %zmm0
_Z3rowPKf:
\tvaddps\t%zmm1, %zmm2, %zmm3
_Z4headPKf:
\tvfnmadd231ps\t-432(%rbp), %zmm0, %zmm2
"""


def test_counts_multiply_adds_with_a_stack_operand_per_function():
    spills = load_script("kernel_spills.py", "kernel_spills_t").spills
    assert spills(ASM) == [("_Z4tilePKf", 3, 1), ("_Z3rowPKf", 0, 0), ("_Z4headPKf", 1, 1)]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler here")
def test_a_kernel_compiles_to_assembly_as_built():
    from kernels_pallas.sampling import cpu

    text = cpu._LIBRARY.assembly()
    assert "NjArgmaxF32" in text and ".text" in text
