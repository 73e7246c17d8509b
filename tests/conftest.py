"""Test configuration shared by every test directory.

Without a CUDA GPU, Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1`` must be set
before kvq's Triton kernels are imported: ``@triton.jit`` reads it when it decorates a kernel, and
``kvq.fast.triton.quant.interpreting`` reports that fact for the whole process), on CPU tensors. With a GPU
(the device machine, ``pytest -m gpu``) the same parity tests run on CUDA tensors for both backends.

The ``fast_target`` fixture yields ``(backend, device)`` pairs:
  ("triton", "cpu")   interpreter, runs in CI;
  ("triton", "cuda")  marked gpu;
  ("cupy", "cuda")    marked gpu.
CI runs ``pytest -m "not gpu"`` so GPU tests are deselected, never counted as skipped passes.

Order independence: every test must pass in any order, alone or beside others in one process.
  * No test may leave ``os.environ`` changed: the autouse fixture ``_no_env_leak`` compares the
    environment before and after every test and fails (an error at teardown) a test that set, changed or
    removed a variable (use ``monkeypatch.setenv`` / ``delenv``, or give a subprocess its own ``env``).
    Only the variables in ``ENV_ALLOWED`` (set by pytest or by libraries themselves) may change.
  * ``pytest --shuffle=SEED`` runs the collected tests in an order shuffled by ``random.Random(SEED)``
    (an integer; the same seed gives the same order, so every pytest-xdist worker collects the same
    list, as xdist requires). It composes with ``-m`` / ``-k`` / ``-n`` and with pytest-randomly (use one
    of them): e.g. ``pytest -m gpu -n 8 --shuffle=1234``.
"""

import os
import random

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the reference tests need no torch
    torch = None
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

FAST_TARGETS = [
    pytest.param(("triton", "cpu"), id="triton-interp"),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    pytest.param(("cupy", "cuda"), id="cupy-cuda", marks=pytest.mark.gpu),
]

#: environment variables a test may change: set by pytest itself, or by libraries on their own (torch.compile
#: with CUDA graphs sets the CUPTI pair, Inductor its cache folders, OpenMP runtimes theirs on import (GPU
#: image), transformers' generate the tokenizers' parallelism, matplotlib a config folder where it has
#: none); none of them decides what kvq does
ENV_ALLOWED = frozenset({"PYTEST_CURRENT_TEST", "DISABLE_CUPTI_LAZY_REINIT", "TEARDOWN_CUPTI",
                         "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                         "KMP_INIT_AT_FORK", "TOKENIZERS_PARALLELISM", "NCCL_GRAPH_MIXING_SUPPORT",
                         "MPLCONFIGDIR"})


def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help="run the collected tests in an order shuffled by random.Random(SEED) (kvq's "
                          "order-independence check; deterministic, so pytest-xdist workers agree)")


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"kvq: test order shuffled with --shuffle={seed}"


@pytest.fixture(params=[pytest.param(p.values[0][1], id=p.id, marks=p.marks) for p in FAST_TARGETS
                        if p.values[0][0] == "triton"])
def triton_device(request):
    """The Triton targets of ``fast_target`` as a device name ("cpu": the interpreter, only without a GPU)."""
    if request.param == "cpu" and _HAS_CUDA:
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    return request.param


def shuffle_items(items, seed: int) -> None:
    """Shuffle the collected ``items`` in place, deterministically for one ``seed``."""
    items[:] = random.Random(seed).sample(items, len(items))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--shuffle=SEED``: shuffle the order (after any other plugin's reordering). Without CUDA, gpu
    tests are skipped with a reason (CI deselects them with ``-m "not gpu"``)."""
    seed = config.getoption("--shuffle")
    if seed is not None:
        shuffle_items(items, seed)
    if _HAS_CUDA:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device"))


def env_changes(before: dict, after: dict, allowed=ENV_ALLOWED) -> list[str]:
    """The variables set, changed or removed between two snapshots of ``os.environ``, as readable lines
    (sorted; those in ``allowed`` left out)."""
    out = []
    for key in sorted(set(before) | set(after)):
        if key in allowed or before.get(key) == after.get(key):
            continue
        if key not in after:
            out.append(f"{key} removed (was {before[key]!r})")
        elif key not in before:
            out.append(f"{key}={after[key]!r} set")
        else:
            out.append(f"{key} changed from {before[key]!r} to {after[key]!r}")
    return out


def restore_env(before: dict, allowed=ENV_ALLOWED) -> None:
    """Put ``os.environ`` back to the snapshot ``before`` (the variables in ``allowed`` stay as they are)."""
    for key in set(os.environ) - set(before) - allowed:
        del os.environ[key]
    for key, value in before.items():
        if key not in allowed and os.environ.get(key) != value:
            os.environ[key] = value


_HOW = "use monkeypatch.setenv / delenv, or give a subprocess its own env"


@pytest.fixture(autouse=True)
def _no_env_leak():
    """Fail a test that leaves ``os.environ`` changed (torn down after every other fixture of the
    test, so ``monkeypatch`` has restored its changes by then); the environment is restored first, so
    the tests that follow are unharmed."""
    before = dict(os.environ)
    yield
    leaked = env_changes(before, dict(os.environ))
    if leaked:
        restore_env(before)
        pytest.fail(f"the test leaked environment changes ({_HOW}): " + "; ".join(leaked), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that changes ``os.environ`` when it is imported (collected) is a collection error:
    its change would reach every test collected after it in the process (the variable is restored)."""
    before = dict(os.environ)
    report = yield
    leaked = env_changes(before, dict(os.environ))
    if leaked and report.outcome == "passed":
        restore_env(before)
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid}: importing it changed the environment ({_HOW}, never "
                           f"os.environ at module level): " + "; ".join(leaked))
    return report


@pytest.fixture(params=FAST_TARGETS)
def fast_target(request):
    """(backend, device) for a parity test; the interpreter target only where no GPU is present."""
    backend, device = request.param
    if device == "cpu" and _HAS_CUDA:
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    if torch is None:
        pytest.fail("torch is required for the fast tier tests")
    return backend, device
