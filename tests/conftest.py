"""Test configuration shared by every test directory.

Without a CUDA GPU, Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1`` must be set
before triton is imported), on CPU tensors. With a GPU (the device machine, ``pytest -m gpu``) the
same parity tests run on CUDA tensors for both backends.

The ``fast_target`` fixture yields ``(backend, device)`` pairs:
  ("triton", "cpu")   interpreter, runs in CI;
  ("triton", "cuda")  marked gpu;
  ("cupy", "cuda")    marked gpu.
CI runs ``pytest -m "not gpu"`` so GPU tests are deselected, never counted as skipped passes.
"""

import os

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


@pytest.fixture(params=[pytest.param(p.values[0][1], id=p.id, marks=p.marks) for p in FAST_TARGETS
                        if p.values[0][0] == "triton"])
def triton_device(request):
    """The Triton targets of ``fast_target`` as a device name ("cpu": the interpreter, only without a GPU)."""
    if request.param == "cpu" and _HAS_CUDA:
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    return request.param


def pytest_collection_modifyitems(config, items):
    """Without CUDA, gpu tests are skipped with a reason (CI deselects them with ``-m "not gpu"``)."""
    if _HAS_CUDA:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device"))


@pytest.fixture(params=FAST_TARGETS)
def fast_target(request):
    """(backend, device) for a parity test; the interpreter target only where no GPU is present."""
    backend, device = request.param
    if device == "cpu" and _HAS_CUDA:
        pytest.skip("the Triton interpreter target runs only on machines without a GPU (CI)")
    if torch is None:
        pytest.fail("torch is required for the fast tier tests")
    return backend, device
