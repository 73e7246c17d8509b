"""The correspondence rule (DESIGN.md section 1): kvq.reference.M.f <-> kvq.fast.<backend>.M.f.

For every module in ``kvq.fast.MIRRORED``: the reference module's ``__all__`` is exactly the mirrored
list; every name exists in each backend's module with the same signature (parameter names, kinds,
defaults) and a docstring that opens with "Mirrors `kvq.reference.", or is listed in
``kvq.fast.NOT_YET_IMPLEMENTED[backend][module]``. Names that are data (configuration classes, the
``CONFIGS`` dicts) are re-exported: the backend's object must BE the reference's (identity). A backend module that cannot be imported here
(the CuPy backend without CuPy) is read with ``ast`` instead.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import numpy as np
import pytest

import kvq.fast as F

CASES = [(m, b) for m in F.MIRRORED for b in F.BACKENDS]


def _reference(module):
    return importlib.import_module(f"kvq.reference.{module}")


@pytest.mark.parametrize("module", list(F.MIRRORED))
def test_reference_all_is_the_mirrored_list(module):
    assert tuple(_reference(module).__all__) == tuple(F.MIRRORED[module])


def _signature_rows(sig: inspect.Signature):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _eq_default(a, b) -> bool:
    if a is inspect.Parameter.empty or b is inspect.Parameter.empty:
        return a is b
    try:
        return bool(a == b) and type(a) is type(b) or a is b
    except Exception:
        return a is b


def _ast_signature(fn: ast.FunctionDef):
    """(name, kind, default) rows of a function definition, defaults evaluated with numpy as np."""
    env = {"np": np, "numpy": np}
    a = fn.args
    rows = []
    positional = a.posonlyargs + a.args
    pdefaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, pdefaults)):
        kind = inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD
        rows.append((arg.arg, kind, d))
    if a.vararg:
        rows.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        rows.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else d))
    if a.kwarg:
        rows.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    out = []
    for name, kind, d in rows:
        if isinstance(d, ast.AST):
            d = eval(compile(ast.Expression(d), "<default>", "eval"), env)   # noqa: S307 (own source)
        out.append((name, kind, d))
    return out


def _backend_module(module: str, backend: str):
    """The backend module, or None where it cannot be imported here (CuPy missing) or does not exist."""
    path = pathlib.Path(F.__file__).parent / backend / f"{module}.py"
    if not path.exists():
        return None
    try:
        return importlib.import_module(f"kvq.fast.{backend}.{module}")
    except ImportError as err:
        if backend != "cupy" or "cupy" not in str(err):
            raise
        return None


def _backend_functions(module: str, backend: str):
    """name -> (signature rows, docstring) for the backend module's top-level functions."""
    path = pathlib.Path(F.__file__).parent / backend / f"{module}.py"
    if not path.exists():
        return {}
    mod = _backend_module(module, backend)
    if mod is not None:
        return {name: (_signature_rows(inspect.signature(obj)), inspect.getdoc(obj) or "")
                for name, obj in vars(mod).items() if inspect.isfunction(obj)}
    tree = ast.parse(path.read_text())
    return {n.name: (_ast_signature(n), ast.get_docstring(n) or "")
            for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("module,backend", CASES, ids=[f"{b}.{m}" for m, b in CASES])
def test_backend_mirrors_reference(module, backend):
    ref = _reference(module)
    fns = _backend_functions(module, backend)
    missing_ok = F.NOT_YET_IMPLEMENTED.get(backend, {}).get(module, {})
    problems = []
    for name in F.MIRRORED[module]:
        ref_obj = getattr(ref, name)
        if not inspect.isfunction(ref_obj):                      # data: re-exported, the same object
            mod = _backend_module(module, backend)
            if mod is None or not hasattr(mod, name):
                if name not in missing_ok:
                    problems.append(f"{name}: missing and not listed in NOT_YET_IMPLEMENTED")
            elif getattr(mod, name) is not ref_obj:
                problems.append(f"{name}: must be the reference's object (re-exported), not a copy")
            continue
        if name not in fns:
            if name not in missing_ok:
                problems.append(f"{name}: missing and not listed in NOT_YET_IMPLEMENTED")
            continue
        want = _signature_rows(inspect.signature(getattr(ref, name)))
        got, doc = fns[name]
        if [(n, k) for n, k, _ in got] != [(n, k) for n, k, _ in want]:
            problems.append(f"{name}: parameters {[(n, k.name) for n, k, _ in got]} != reference "
                            f"{[(n, k.name) for n, k, _ in want]}")
        else:
            for (n, _, dg), (_, _, dw) in zip(got, want):
                if not _eq_default(dg, dw):
                    problems.append(f"{name}: default of {n} is {dg!r}, reference has {dw!r}")
        if not doc.startswith(f"Mirrors `kvq.reference.{module}.{name}`"):
            problems.append(f"{name}: docstring must open with \"Mirrors `kvq.reference.{module}.{name}`\"; "
                            f"it opens with {doc[:60]!r}")
    assert not problems, f"kvq.fast.{backend}.{module}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("backend", F.BACKENDS)
def test_not_yet_implemented_names_are_real(backend):
    """Entries of NOT_YET_IMPLEMENTED name mirrored functions that the backend indeed lacks."""
    for module, names in F.NOT_YET_IMPLEMENTED.get(backend, {}).items():
        assert module in F.MIRRORED
        fns = _backend_functions(module, backend)
        mod = _backend_module(module, backend)
        for name in names:
            assert name in F.MIRRORED[module], (module, name)
            assert not (mod is not None and hasattr(mod, name)) and name not in fns, f"kvq.fast.{backend}.{module}.{name} exists: remove it from NOT_YET_IMPLEMENTED"


def test_the_shared_fast_logic_is_a_named_layer():
    """The fourth column is visible: kvq.fast has no private top-level modules; the shared cache logic is
    ``kvq.fast.caches``, every module of it documented and listed in the package's docstring."""
    root = pathlib.Path(F.__file__).parent
    assert sorted(p.name for p in root.glob("_*.py") if p.name != "__init__.py") == []
    caches = importlib.import_module("kvq.fast.caches")
    names = sorted(p.stem for p in (root / "caches").glob("*.py") if p.stem != "__init__")
    assert names, "kvq/fast/caches holds no modules"
    for name in names:
        mod = importlib.import_module(f"kvq.fast.caches.{name}")
        assert (mod.__doc__ or "").strip(), f"kvq.fast.caches.{name} has no docstring"
        assert f"``{name}``" in caches.__doc__, f"kvq.fast.caches' docstring does not list {name}"


def _kvq_module_aliases(path: pathlib.Path, tree, modules: dict) -> dict:
    """alias -> kvq module name, for every ``import kvq.x as a`` / ``from kvq.x import y [as a]`` (y a module)
    of a module of kvq (relative imports resolved)."""
    root = pathlib.Path(F.__file__).parents[1]
    cur = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    pkg = cur.split(".")[:-1] if path.name != "__init__.py" else cur.split(".")[:-1]
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg[: len(pkg) - (n.level - 1)]
                base = ".".join(up + ([n.module] if n.module else []))
            for a in n.names:
                if f"{base}.{a.name}" in modules:
                    out[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.asname and a.name in modules:
                    out[a.asname] = a.name
    return out


def test_no_module_reaches_into_another_modules_private_names():
    """Issue 38: a module of kvq uses another module's public names only: no ``other._helper`` on an imported
    kvq module, no ``from kvq.x import _helper``. (A private module of a backend, such as
    ``kvq.fast.cupy._loader``, may be imported by its own backend; what it offers is public.)"""
    root = pathlib.Path(F.__file__).parents[1]
    paths = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        aliases = _kvq_module_aliases(path, tree, modules)
        me = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases:
                if n.attr.startswith("_") and not n.attr.startswith("__") and aliases[n.value.id] != me:
                    found.append(f"{path.relative_to(root.parent)}:{n.lineno}: {n.value.id}.{n.attr}")
            elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("kvq")):
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and \
                            not any(k.endswith(f".{a.name}") for k in modules):
                        found.append(f"{path.relative_to(root.parent)}:{n.lineno}: from {n.module} import {a.name}")
    assert not found, "private names used across modules:\n  " + "\n  ".join(found)


def _import_graph(root: pathlib.Path) -> dict:
    """module -> the kvq modules it imports anywhere in its code (module level and inside functions), from
    the source (``ast``): ``from kvq.x import y`` names the module ``kvq.x.y`` where that is one, else
    ``kvq.x``; relative imports resolved."""
    paths = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}
    graph = {}
    for name, path in mods.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    base = ".".join(pkg[: len(pkg) - (n.level - 1)] + ([n.module] if n.module else []))
                for a in n.names:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "kvq"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvq.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")          # inside a function too
    (pkg / "sub" / "c.py").write_text("from ..a import x\n")
    (pkg / "d.py").write_text("import kvq.a\n")
    assert _circles(_import_graph(pkg)) == [["kvq.a", "kvq.sub.b", "kvq.sub.c"]]


def test_kvq_has_no_import_circles():
    """Issue 38: no two modules of kvq import each other, directly or around a loop, not even inside a
    function (the last two were ``kvq.fast.common.interpreting`` importing ``kvq.fast.triton.quant``, and
    the reference's paged / state dispatching on the method modules that import them)."""
    circles = _circles(_import_graph(pathlib.Path(F.__file__).parents[1]))
    assert not circles, "import circles in kvq:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)
