"""Parity-test settings: the Triton interpreter evaluates masked lanes (0 / 0 in padding, NaN casts)
with NumPy, which warns; those warnings say nothing about the results and are silenced here."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/parity" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"))


@pytest.fixture
def triton_dispatches(monkeypatch):
    """The Triton kernels that go through Triton's dispatch (``JITFunction.run``, wrapped) during the test:
    a planned launch that holds its compiled kernel makes none. Clear it after a warm-up call."""
    import triton

    real = triton.runtime.jit.JITFunction.run
    seen = []

    def counted(self, *a, **kw):
        seen.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", counted)
    return seen
