"""The CUDA sources of the CuPy backend compile with nvcc for sm_90, every kernel the loader asks for.

Runs in CI (no GPU needed, only nvcc). Plain `nvcc -c` of a template source only parses the templates,
so a second compile includes each source and takes the address of every name expression listed in
``kvq.fast.cupy._loader.KERNELS`` (or, for a source its module builds itself, that module's list:
``OWN``), which instantiates (and type-checks, and runs ptxas on) each one.

Each compile writes a line to pytest's output as it starts and its seconds when it ends (``nvcc quant.cu
(instantiate 66 kernels) ... 16.9 s``), past pytest's output capture: a compile can take minutes, and
``pytest -q`` (``make test``) prints a test's dot only when the test ends.

    pytest tests/fast/test_cuda_compile.py -m nvcc
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from kvq.fast.cupy import _loader
from kvq.fast.cupy import oscar_append as _oscar_append

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[2]
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


def _compile(cu: Path, out: Path, extra=(), progress=None, what=""):
    """nvcc ``cu`` to ``out``; its output (the test fails where nvcc does). ``progress`` (the fixture) shows
    ``nvcc <what> ... <seconds> s`` in pytest's output while it runs."""
    cmd = [_nvcc(), *FLAGS, *extra, "-c", "-o", str(out), str(cu)]
    with progress(what or cu.name) if progress else nullcontext():
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{log}"
    return log


@pytest.fixture()
def progress(request, capsys):
    """``with progress("paged.cu (parse)"): ...`` writes ``nvcc paged.cu (parse) ... `` to pytest's terminal
    as the block starts and its wall seconds when it ends, past output capture, so that a long compile is
    visible in ``make test`` (``-q``: one dot per finished test). With ``-v`` the test's own line already
    names it, and only `` nvcc 16.9 s`` is added before its PASSED. Silent where pytest has no terminal
    reporter (an xdist worker, ``-p no:terminal``)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    verbose = request.config.get_verbosity() > 0

    def write(text, new_line=False):
        if reporter is None:
            return
        with capsys.disabled():
            tw = request.config.get_terminal_writer()
            if new_line and tw.width_of_current_line:          # after the dots of earlier tests
                text = "\n" + text
            tw.write(text, flush=True)

    @contextmanager
    def compiling(what: str):
        start = time.perf_counter()
        write("" if verbose else f"nvcc {what} ... ", new_line=not verbose)
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            write(f"nvcc {seconds:.1f} s " if verbose else f"{seconds:.1f} s\n")

    return compiling


def test_loader_imports_without_cupy():
    """The loader is importable without CuPy (it imports CuPy inside its functions)."""
    assert set(SOURCES) == {"quant.cu", "attention.cu", "paged.cu", "flush.cu", "higgs.cu", "oscar.cu", "oscar_decode.cu",
                            "aqua.cu", "bitdecoding.cu", "bitdecoding_decode.cu"}
    assert all(_loader.KERNELS[s] for s in SOURCES)


@pytest.mark.parametrize("name", ALL)
def test_source_compiles(name, tmp_path, progress):
    log = _compile(SRC / name, tmp_path / (name + ".o"), progress=progress, what=f"{name} (parse)")
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("name", ALL)
def test_every_requested_kernel_instantiates(name, tmp_path, progress):
    """Each name expression of the loader names a kernel template of the source and compiles."""
    exprs = NAMES[name]
    wrapper = tmp_path / ("inst_" + name)
    lines = [f'#include "{SRC / name}"', "void* kvq_instances[] = {"]
    lines += [f"    (void*)&{e}," for e in exprs]
    lines += ["};"]
    wrapper.write_text("\n".join(lines) + "\n")
    log = _compile(wrapper, tmp_path / "inst.o", extra=["-Xptxas", "-warn-spills"], progress=progress,
                   what=f"{name} (instantiate {len(exprs)} kernels)")
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



@pytest.mark.parametrize("flag, line", [
    ("-q", r"nvcc quant\.cu \(parse\) \.\.\. \d+\.\d s"),
    ("-v", r".*::test_source_compiles\[quant\.cu\] nvcc \d+\.\d s PASSED.*")])
def test_each_compile_shows_a_line_with_its_seconds(flag, line, tmp_path):
    """pytest -q (make test) shows every compile on its own line with its seconds, though pytest captures a
    test's output (-v: the seconds on the test's line); a stand-in nvcc on PATH makes the compile instant."""
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", f"{Path(__file__).relative_to(ROOT)}::test_source_compiles[quant.cu]",
           flag, "-p", "no:randomly", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert any(re.fullmatch(line, ln) for ln in res.stdout.splitlines()), res.stdout
