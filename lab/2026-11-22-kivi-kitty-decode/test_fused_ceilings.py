"""fused_ceilings.py (beside this file): its probe patch still applies to paged.cu (so a kernel change that
breaks it shows here, not on the device), leaves the checkout alone, and the patched kernel compiles (nvcc).

A lab test (not collected by ``make test``: pytest's testpaths are ``tests/``); run it by hand:
``.venv/bin/python -m pytest lab/2026-11-22-kivi-kitty-decode/test_fused_ceilings.py -q``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]                           # the repository
HERE = Path(__file__).resolve().parent


def _module():
    spec = importlib.util.spec_from_file_location("fused_ceilings", HERE / "fused_ceilings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_patch_applies_to_a_copy(tmp_path):
    before = (ROOT / "kvq" / "fast" / "cupy" / "paged.cu").read_text()
    FC = _module()
    FC.patched_tree(str(tmp_path))
    text = (tmp_path / "kvq" / "fast" / "cupy" / "paged.cu").read_text()
    assert text.count("kvq_probe & 1") == 2 and text.count("kvq_probe & 2") == 1
    assert "kvq_probe" not in before                          # the production kernel carries no probe
    assert (ROOT / "kvq" / "fast" / "cupy" / "paged.cu").read_text() == before
    # every edit replaced what it names: the patched text holds each new snippet once
    for _, new in FC._PATCH:
        assert text.count(new) == 1


def test_patch_fails_loudly_when_the_kernel_changed(tmp_path, monkeypatch):
    FC = _module()
    monkeypatch.setattr(FC, "_PATCH", FC._PATCH + [("text that paged.cu does not hold", "x")])
    with pytest.raises(SystemExit, match="no longer applies"):
        FC.patched_tree(str(tmp_path))


@pytest.mark.nvcc
def test_patched_kernel_compiles(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (CI has it)")
    FC = _module()
    tree = Path(FC.patched_tree(str(tmp_path / "tree")))
    cu = tree / "kvq" / "fast" / "cupy" / "paged.cu"
    wrapper = tmp_path / "inst.cu"
    wrapper.write_text(f'#include "{cu}"\nvoid* kvq_instances[] = {{(void*)&paged_decode_mma2<0, 4, 2, 2>,'
                       f' (void*)&paged_decode_mma2<1, 4, 2, 2>}};\n')
    res = subprocess.run([nvcc, "-arch=sm_90", "--fmad=false", "-std=c++17", "-c", "-o", str(tmp_path / "i.o"),
                          str(wrapper)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
