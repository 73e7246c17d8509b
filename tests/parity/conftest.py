"""Parity-test settings: the Triton interpreter evaluates masked lanes (0 / 0 in padding, NaN casts)
with NumPy, which warns; those warnings say nothing about the results and are silenced here."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/parity" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"))
