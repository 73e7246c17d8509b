"""kvq.reference never imports torch, triton, cupy or kvq.fast (DESIGN.md section 1).

Two checks: every reference module imports in a fresh interpreter in which those packages are
blocked (``sys.modules[name] = None`` makes any import of them fail), and no reference source file
contains an import statement naming them (read with ``ast``, so imports inside functions count too).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import kvq.reference

BLOCKED = ("torch", "triton", "cupy", "kvq.fast")
REF_DIR = pathlib.Path(kvq.reference.__file__).parent
SOURCES = sorted(REF_DIR.rglob("*.py"))
MODULES = sorted({"kvq.reference." + ".".join(p.relative_to(REF_DIR).with_suffix("").parts)
                  for p in SOURCES if p.name != "__init__.py"} | {"kvq.reference"})


def test_reference_modules_import_with_fast_packages_blocked():
    code = "\n".join([
        "import sys, importlib",
        f"for name in {BLOCKED!r}:",
        "    sys.modules[name] = None",
        f"for mod in {MODULES!r}:",
        "    importlib.import_module(mod)",
        "leaked = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'cupy') and sys.modules[m] is not None]",
        "assert not leaked, leaked",
        "print('ok', len(" + repr(MODULES) + "))",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok")


def _imported_names(tree: ast.AST, package: str):
    """Absolute module names of every import statement in a module of ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod
            for alias in node.names:
                yield f"{mod}.{alias.name}"


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REF_DIR)) for p in SOURCES])
def test_reference_source_has_no_fast_imports(path):
    rel = path.relative_to(REF_DIR).with_suffix("").parts
    package = ".".join(("kvq", "reference") + rel[:-1])           # the package the file lives in
    bad = [name for name in _imported_names(ast.parse(path.read_text()), package)
           if any(name == b or name.startswith(b + ".") for b in BLOCKED)]
    assert not bad, f"{path.name} imports {sorted(set(bad))}"


def test_the_check_sees_relative_imports():
    """A relative import that reaches kvq.fast from the reference is caught."""
    tree = ast.parse("from ..fast import quantize\nfrom . import numerics\nimport torch.nn")
    names = set(_imported_names(tree, "kvq.reference"))
    assert "kvq.fast" in names and "torch.nn" in names and "kvq.reference.numerics" in names


#: what the NumPy-only install uses beyond kvq.reference (README: the memory accounting, ``kvq demo``)
NUMPY_ONLY = ("kvq.cli", "kvq.demo", "kvq.integrations.methods")


def test_numpy_only_modules_import_without_torch():
    """The CLI, the demo and the method registry (bits per element of every method) import with torch,
    triton and cupy blocked; kvq.fast, which needs torch, is imported only where torch is in use."""
    code = "\n".join([
        "import sys, importlib",
        "for name in ('torch', 'triton', 'cupy'):",
        "    sys.modules[name] = None",
        f"for mod in {NUMPY_ONLY!r}:",
        "    importlib.import_module(mod)",
        "from kvq.integrations import methods",
        "cfg = methods.get_method('KIVI-K2V2').base()",
        "print('ok', methods.bits_per_element('KIVI-K2V2', cfg, context=4096, head_dim=128, kv_heads=8, n_layers=2))",
    ])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok")
