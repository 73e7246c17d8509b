"""``kvq.fast.validation``: the context manager form of ``set_validation`` (CPU, no kernels)."""

import pytest

from kvq.fast import common as C


@pytest.fixture(autouse=True)
def _restore():
    before = C.validation_enabled()
    yield
    C.set_validation(before)


@pytest.mark.parametrize("outer", [True, False])
def test_validation_block_sets_and_restores(outer):
    """Inside the block the given setting, after it the one before; nested blocks unwind in order."""
    C.set_validation(outer)
    with C.validation(not outer):
        assert C.validation_enabled() is (not outer)
        with C.validation(outer):
            assert C.validation_enabled() is outer
        assert C.validation_enabled() is (not outer)
    assert C.validation_enabled() is outer


def test_validation_block_restores_on_error():
    """An exception inside the block propagates, and the setting before it comes back."""
    C.set_validation(True)
    with pytest.raises(KeyError):
        with C.validation(False):
            assert not C.validation_enabled()
            raise KeyError("x")
    assert C.validation_enabled()


def test_validation_block_takes_truthy_values():
    """``enabled`` is read as a bool (as ``set_validation``)."""
    C.set_validation(False)
    with C.validation(1):
        assert C.validation_enabled() is True
    assert C.validation_enabled() is False
