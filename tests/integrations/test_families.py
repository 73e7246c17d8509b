"""Every method behind one interface (issue 37, item 2): ``kvq.integrations.families`` holds each family's
behaviour, and the store, the configuration and the attention function dispatch through it without
branching on the family."""

import ast
import importlib
import inspect

import numpy as np
import pytest
import torch

from kvq.integrations import families as F
from kvq.integrations import methods as M

from .small import SMALL

B, H, D, L = 1, 2, 64, 2


def test_every_method_has_its_family_class():
    for name, spec in M.METHODS.items():
        fam = F.family_of(spec)
        assert issubclass(fam, F.Family) and fam.name == spec.family, name
        assert fam.calibration == spec.calibration, name


def _family_comparisons(source: str) -> list:
    """Comparisons in ``source`` whose operands name a family (``spec.family == ...``, ``fam in (...)``)."""
    def names_family(node):
        return any(isinstance(n, ast.Attribute) and n.attr == "family" or isinstance(n, ast.Name) and n.id == "fam"
                   for n in ast.walk(node))
    return [ast.unparse(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare) and names_family(n)]


def test_the_guard_finds_a_branch():
    assert _family_comparisons("if spec.family == 'aqua':\n    pass\nx = fam in ('kivi', 'kitty')") == [
        "spec.family == 'aqua'", "fam in ('kivi', 'kitty')"]


@pytest.mark.parametrize("module", ["kvq.integrations.methods", "kvq.integrations.attention"])
def test_no_branch_on_the_family(module):
    """The store, configure, the accounting and the attention function read the same for every method."""
    assert _family_comparisons(inspect.getsource(importlib.import_module(module))) == []


@pytest.mark.parametrize("name", list(M.METHODS))
def test_store_decode_attention_is_the_attention_functions(name):
    """``KVStore.decode_attention`` (the family's decode) is what the "kvq" attention function runs, and it
    agrees with SDPA over the store's own dequantized cache."""
    pytest.importorskip("transformers")
    from kvq.integrations.attention import decode

    cal = "identity" if M.METHODS[name].calibration else None
    store = M.KVStore(name, n_layers=L, batch=B, kv_heads=H, head_dim=D, max_tokens=128, calibration=cal,
                      **SMALL[name])
    rng = np.random.default_rng(0)
    for T in (40, 1, 1):
        for l in range(L):
            store.append(l, *(rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(2)))
    q = torch.from_numpy(rng.standard_normal((B, 2 * H, 1, D)).astype(np.float32))
    for l in range(L):
        out = store.decode_attention(l, q)
        assert torch.equal(out, decode(store, l, q))
        K, V = store.keys_values(l)
        want = torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    assert store.exact is (name == "FP16")
