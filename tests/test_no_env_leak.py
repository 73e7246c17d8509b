"""Order independence (issue 36): no environment variable decides where data lives mid-process, and no
test leaks an environment change.

* ``kvq.fast.triton.quant.interpreting()`` is a fact fixed once per process (how ``@triton.jit`` decorated
  kvq's kernels), not a read of ``TRITON_INTERPRET`` at call time;
* ``kvq.fast.common.cache_device(ops, device)``: an explicit device wins, validated; None -> the CPU under
  the interpreter, else the current CUDA device;
* tests/conftest.py fails a test (or a test module at import) that leaves ``os.environ`` changed, and
  ``--shuffle=SEED`` shuffles the collection deterministically.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvq.fast import common as C  # noqa: E402
from kvq.fast.triton import quant as Q  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _ops(name="triton", cpu=True):
    return types.SimpleNamespace(name=name, allow_cpu=lambda: cpu)


def _run(code, *, interpret, timeout=300):
    """Run ``code`` in a fresh Python with TRITON_INTERPRET set to "1" (interpret=True) or unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- interpreting()

def test_interpreting_matches_the_kernels_in_this_process():
    """The answer is the type of kvq's decorated kernels (Triton's own decision)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kvq.fast.triton import attention, quant
    for mod in (quant, attention):
        kernels = [k for n, k in vars(mod).items() if n.endswith("_kernel")]
        assert kernels and all(isinstance(k, InterpretedFunction) == Q.interpreting() for k in kernels)
    assert Q.interpreting() == (not HAS_CUDA)         # tests/conftest.py sets the variable only without CUDA


@pytest.mark.parametrize("value", [None, "0", "1"])
def test_environment_changes_decide_nothing_mid_process(value, monkeypatch):
    """Setting or removing TRITON_INTERPRET after the kernels exist changes neither interpreting() nor
    where a new cache lives (the GPU suite failed in any order because it did)."""
    from kvq.fast.triton import kivi
    want = Q.interpreting()
    home = torch.device("cpu") if want else torch.device("cuda", torch.cuda.current_device())
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert Q.interpreting() is want
    assert C.cache_device(kivi.paged.OPS) == home
    st = kivi.init(kivi.CONFIGS["KIVI-K2V2"], 1, 1, 128)
    assert st.device == home and all(a.device == home for a in st.arrays().values())


def test_interpreting_in_fresh_processes():
    """Set before the import: True, and unsetting it later changes nothing; unset: False; set only after
    kvq's kernels were decorated (compiled kernels): False."""
    code = """
        import os
        from kvq.fast.triton import quant as Q
        a = Q.interpreting()
        os.environ.pop("TRITON_INTERPRET", None)
        print(a, Q.interpreting())
    """
    assert _run(code, interpret=True) == "True True"
    assert _run("from kvq.fast.triton import quant as Q; print(Q.interpreting())", interpret=False) == "False"
    late = """
        import os
        import kvq.fast.triton.quant as Q
        os.environ["TRITON_INTERPRET"] = "1"
        print(Q.interpreting())
    """
    assert _run(late, interpret=False) == "False"


def test_kvstore_and_bench_use_the_same_fact(monkeypatch):
    """kvq.fast.triton_interpreting (what KVStore and ``kvq bench e2e`` ask) is the kernels' fact, whatever
    the environment says now."""
    import kvq.fast
    from kvq.commands import CommandError
    from kvq.commands.bench_e2e import check_cache_name
    monkeypatch.setenv("TRITON_INTERPRET", "0" if Q.interpreting() else "1")
    assert kvq.fast.triton_interpreting() is Q.interpreting()
    if Q.interpreting():
        check_cache_name("KIVI-K2V2:triton", "cpu")                 # accepted: the kernels run on the CPU
    else:
        with pytest.raises(CommandError, match="interpreter"):
            check_cache_name("KIVI-K2V2:triton", "cpu")


def test_triton_interpreting_is_false_without_triton(monkeypatch):
    import builtins

    import kvq.fast
    real = builtins.__import__

    def no_triton(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "kvq.fast.triton" or name.startswith("kvq.fast.triton.") or name == "triton":
            raise ImportError(f"no module named {name!r} (test)")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert kvq.fast.triton_interpreting() is False


# ----------------------------------------------------------------------------- cache_device()

def test_cache_device_default():
    assert C.cache_device(_ops(cpu=True)) == torch.device("cpu")
    if HAS_CUDA:
        assert C.cache_device(_ops(cpu=False)) == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(RuntimeError, match="CUDA device.*interpreter"):
            C.cache_device(_ops(cpu=False))
        with pytest.raises(RuntimeError, match="kvq.fast.cupy caches live on a CUDA device"):
            C.cache_device(_ops("cupy", cpu=False))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cache_device_cpu_only_under_the_interpreter(device):
    assert C.cache_device(_ops(cpu=True), device) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device=.*cpu.*CUDA device.*TRITON_INTERPRET=1"):
        C.cache_device(_ops(cpu=False), device)
    with pytest.raises(ValueError, match=r"kvq.fast.cupy caches live on a CUDA device$"):
        C.cache_device(_ops("cupy", cpu=False), device)


@pytest.mark.parametrize("device, err, match", [
    (1.5, TypeError, "device must be a torch.device"),
    (True, TypeError, "device must be a torch.device"),
    ([0], TypeError, "got list"),
    ("nonsense", ValueError, "device='nonsense' is not a device name"),
    (-1, ValueError, "a CUDA index must be >= 0"),
    ("meta", ValueError, "not meta"),
    ("cuda:99", ValueError, "device='cuda:99'"),
    (99, ValueError, "device=99"),
])
def test_cache_device_refuses(device, err, match):
    for cpu in (True, False):
        with pytest.raises(err, match=match):
            C.cache_device(_ops(cpu=cpu), device)


def test_cache_device_cuda_without_a_gpu():
    if HAS_CUDA:
        pytest.skip("this machine has a GPU: see test_cache_device_cuda")
    for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
        with pytest.raises(ValueError, match="no CUDA device is available"):
            C.cache_device(_ops(cpu=True), device)


@pytest.mark.gpu
def test_cache_device_cuda():
    cur = torch.device("cuda", torch.cuda.current_device())
    n = torch.cuda.device_count()
    for cpu in (True, False):                           # an explicit CUDA device wins over the default
        assert C.cache_device(_ops(cpu=cpu), "cuda") == cur
        assert C.cache_device(_ops(cpu=cpu), torch.device("cuda")) == cur
        assert C.cache_device(_ops(cpu=cpu), n - 1) == torch.device("cuda", n - 1)
        assert C.cache_device(_ops(cpu=cpu), f"cuda:{n - 1}") == torch.device("cuda", n - 1)
        with pytest.raises(ValueError, match=f"there is no CUDA device {n}"):
            C.cache_device(_ops(cpu=cpu), f"cuda:{n}")


# ----------------------------------------------------------------------------- the conftest guards

def _pytest(tmp_path, *args):
    """Run pytest on ``tmp_path`` with a copy of tests/conftest.py; returns (exit code, output)."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "--rootdir", str(tmp_path), "-q", str(tmp_path), *args],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    return res.returncode, res.stdout + res.stderr


def test_a_leaking_test_fails(tmp_path):
    (tmp_path / "test_leaks.py").write_text(textwrap.dedent("""
        import os

        def test_sets():
            os.environ["KVQ_LEAK_A"] = "1"

        def test_sees_nothing():
            assert "KVQ_LEAK_A" not in os.environ

        def test_monkeypatch_is_fine(monkeypatch):
            monkeypatch.setenv("KVQ_LEAK_B", "1")
            monkeypatch.delenv("HOME", raising=False)
    """))
    code, out = _pytest(tmp_path)
    assert code == 1, out
    assert "3 passed, 1 error" in out, out
    assert "leaked environment changes" in out and "KVQ_LEAK_A='1' set" in out, out


def test_a_module_leaking_at_import_is_a_collection_error(tmp_path):
    (tmp_path / "test_import_leak.py").write_text(
        "import os\nos.environ.setdefault('KVQ_LEAK_C', '1')\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_after.py").write_text(
        "import os\n\ndef test_clean():\n    assert 'KVQ_LEAK_C' not in os.environ\n")
    code, out = _pytest(tmp_path, "--continue-on-collection-errors")
    assert code == 1, out
    assert "importing it changed the environment" in out and "KVQ_LEAK_C='1' set" in out, out
    assert "1 passed" in out, out


def test_shuffle_is_deterministic(tmp_path):
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(30))\ndef test_i(i):\n    pass\n")

    def order(*args):
        code, out = _pytest(tmp_path, "--collect-only", *args)
        assert code == 0, out
        return [ln for ln in out.splitlines() if "::" in ln]

    plain, a, c = order(), order("--shuffle=7"), order("--shuffle=8")
    assert len(plain) == 30 and sorted(a) == sorted(plain)
    assert a != plain and a != c
    code, out = _pytest(tmp_path, "--shuffle=7", "-vv")              # -q -vv: header and test names
    assert code == 0 and "30 passed" in out and "order shuffled with --shuffle=7" in out, out
    assert [ln.split()[0] for ln in out.splitlines() if ln.endswith("%]")] == a, out     # the same order
