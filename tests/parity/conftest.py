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


class Launches(list):
    """The planned launches of a test, in call order, as (``Launch``, its arguments) (``planned_launches``)."""

    def kernels(self) -> list:
        """The kernel of each launch."""
        return [la.kernel for la, _ in self]

    def grids(self, kernel) -> list:
        """The grids of ``kernel``'s launches."""
        return [la.grid for la, _ in self if la.kernel is kernel]


@pytest.fixture
def planned_launches(monkeypatch):
    """Every planned Triton launch (``kvq.fast.triton._launch.Launch``, wrapped) during the test, run as
    before and recorded in ``Launches`` (clear it to start counting later)."""
    from kvq.fast.triton import _launch as L

    real = L.Launch.__call__
    seen = Launches()

    def recorded(self, args, stream, device_index):
        seen.append((self, args))
        return real(self, args, stream, device_index)

    monkeypatch.setattr(L.Launch, "__call__", recorded)
    return seen
