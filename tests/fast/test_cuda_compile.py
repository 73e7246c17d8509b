"""The CUDA sources of the CuPy backend compile with nvcc for sm_90, every kernel the loader asks for.

Runs in CI (no GPU needed, only nvcc). Plain `nvcc -c` of a template source only parses the templates,
so a second compile includes each source and takes the address of every name expression listed in
``kvq.fast.cupy._loader.KERNELS`` (or, for a source its module builds itself, that module's list:
``OWN``), which instantiates (and type-checks, and runs ptxas on) each one.

    pytest tests/fast/test_cuda_compile.py -m nvcc
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvq.fast.cupy import _loader
from kvq.fast.cupy import oscar_append as _oscar_append

pytestmark = pytest.mark.nvcc

SRC = Path(_loader.__file__).resolve().parent
SOURCES = sorted(_loader.KERNELS)
#: sources compiled by their own module (with _loader.source / OPTIONS) -> its kernel name expressions
OWN = {"oscar_append.cu": _oscar_append.NAMES}
NAMES = {**{s: _loader.KERNELS[s] for s in SOURCES}, **OWN}
ALL = sorted(NAMES)
FLAGS = ["-arch=sm_90", "--fmad=false", "-std=c++17"]


def _nvcc():
    exe = shutil.which("nvcc")
    if exe is None:
        pytest.skip("nvcc is not on PATH (CI has it: the CUDA sources are compiled there)")
    return exe


def _compile(cu: Path, out: Path, extra=()):
    cmd = [_nvcc(), *FLAGS, *extra, "-c", "-o", str(out), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{log}"
    return log


def test_loader_imports_without_cupy():
    """The loader is importable without CuPy (it imports CuPy inside its functions)."""
    assert set(SOURCES) == {"quant.cu", "attention.cu", "paged.cu", "flush.cu", "higgs.cu", "oscar.cu", "oscar_decode.cu",
                            "aqua.cu", "bitdecoding.cu", "bitdecoding_decode.cu"}
    assert all(_loader.KERNELS[s] for s in SOURCES)


@pytest.mark.parametrize("name", ALL)
def test_source_compiles(name, tmp_path):
    log = _compile(SRC / name, tmp_path / (name + ".o"))
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("name", ALL)
def test_every_requested_kernel_instantiates(name, tmp_path):
    """Each name expression of the loader names a kernel template of the source and compiles."""
    exprs = NAMES[name]
    wrapper = tmp_path / ("inst_" + name)
    lines = [f'#include "{SRC / name}"', "void* kvq_instances[] = {"]
    lines += [f"    (void*)&{e}," for e in exprs]
    lines += ["};"]
    wrapper.write_text("\n".join(lines) + "\n")
    log = _compile(wrapper, tmp_path / "inst.o", extra=["-Xptxas", "-warn-spills"])
    assert "error" not in log.lower(), log


@pytest.mark.parametrize("name", ALL)
def test_requested_names_are_defined(name):
    """Parse: every kernel base name the loader requests is a __global__ function of the source."""
    text = _loader.source(name)
    defined = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^;{]*?\)\s*)?(\w+)\s*\(", text))
    wanted = {e.split("<")[0].strip() for e in NAMES[name]}
    assert wanted <= defined, f"{name}: requested but not defined: {sorted(wanted - defined)}"


def test_launch_constants_match_the_kernels():
    """The Python launchers size blocks from constants that must agree with quant.cu."""
    from kvq.fast.cupy import quant

    text = _loader.source("quant.cu")
    maxty = {int(v) for v in re.findall(r"constexpr int MAXTY = (\d+);", text)}
    assert maxty == {quant._MAXTY}, (maxty, quant._MAXTY)
    assert {int(v) for v in re.findall(r"constexpr int R = (\d+);", text)} == {quant._R}
    assert {int(v) for v in re.findall(r"constexpr int K = (\d+);", text)} == {quant._CACHED}
    assert 32 * quant._MAXTY <= 256 and "__launch_bounds__(256, 4) quant_cols" in text
    from kvq.fast.cupy import attention

    text = _loader.source("attention.cu")
    assert f"__launch_bounds__({32 * attention.MERGE_WARPS}) attn_merge" in text
    assert f"constexpr int CH = {attention.MERGE_CHUNK};" in text
    assert f"constexpr int NWB = {attention.MERGE_WARPS};" in text
    assert [attention.merge_warps_per_row(S) for S in (1, 8, 9, 16, 17, 500)] == [1, 1, 2, 2, 4, 4]
    text = _loader.source("paged.cu")                   # paged_tail_mma's tile rows (mma.cuh) and smem per warp
    assert f"#define KVQ_TMMA_ROW {_loader.TAIL_MMA_ROW}" in text
    assert _loader.tail_mma_warp_bytes() == 2 * 32 * _loader.TAIL_MMA_ROW * 2 == 17408


@pytest.mark.parametrize("D, ndl", [(16, 1), (32, 1), (64, 2), (100, 4), (128, 4), (256, 8), (512, 8)])
def test_merge_dims_per_lane(D, ndl):
    """attn_merge's lanes cover the head dim with the fewest dims per lane it is built for (D > 256: 8,
    the grid's second dimension takes the rest)."""
    assert _loader.merge_dims_per_lane(D) == ndl
    assert f"attn_merge<0, {ndl}>" in _loader.KERNELS["attention.cu"]


def test_sources_are_self_contained():
    """After the loader pastes local headers, no #include remains (NVRTC needs no include path)."""
    for name in ALL:
        text = _loader.source(name)
        assert not re.search(r"^\s*#\s*include", text, re.MULTILINE), f"{name} still includes something"
        assert "__global__" in text
