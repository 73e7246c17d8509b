"""Bad input to the Hugging Face caches (``kvq.integrations.transformers.make_cache`` on a tiny Llama
config, every method, reference backend): ``cache.update`` and the cache's constructor.

A rejected first update must not create the store nor fix the batch size (issue 36 item 2); a NumPy k is
refused before anything is appended; an fp16 model never gets inf keys back (item 4); after any rejected
call, a good update gives what it gives on an untouched twin.
"""

from __future__ import annotations

import pytest
import torch

from kvq.integrations import methods as M

from ..integrations.small import SMALL
from ._core import ERROR, OK_OR_ERROR, Recorder, all_finite, import_keeping_env, results_close, snapshot, snapshot_diff
from .test_store_battery import predictors

try:
    transformers = import_keeping_env("transformers")
    make_cache = import_keeping_env("kvq.integrations.transformers").make_cache
except ImportError:  # as pytest.importorskip: the HF extra is not installed
    pytest.skip("transformers is not installed", allow_module_level=True)

L, H, D, CAP = 2, 2, 64, 128
NAMES = list(M.METHODS)


def config():
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=H,
        head_dim=D,
        max_position_embeddings=512,
    )


def calibration(name):
    if name == "OSCAR":
        return "identity"
    if M.METHODS[name].family == "aqua":
        return predictors(F=H * D)
    return None


def build(name, T0=0, B=1, dtype=torch.float32):
    cache = make_cache(
        name, config(), backend="reference", calibration=calibration(name), max_tokens=CAP, **SMALL[name]
    )
    for l in range(L):
        if T0:
            cache.update(*kv(T0, 10 + l, B, dtype), l)
    return cache


def kv(T, seed, B=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((B, H, T, D), generator=g).to(dtype) for _ in range(2))


def good_step(cache, B, dtype=torch.float32):
    return [cache.update(*kv(2, 50 + l, B, dtype), l) for l in range(L)]


def followup(victim, twin, B):
    try:
        got = good_step(victim, B)
    except Exception as e:  # noqa: BLE001
        return f"a good update (batch {B}) afterwards raised {type(e).__name__}: {str(e)[:200]}"
    want = good_step(twin, B)
    why = results_close(got, want, rtol=0)
    if why:
        return f"a good update afterwards returned other keys / values than an untouched twin: {why}"
    diff = snapshot_diff(snapshot(twin), snapshot(victim))
    return None if not diff else f"after a good update the cache differs from an untouched twin at {diff}"


def _nan(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _extreme(t):
    t = t.to(torch.float16).clone()
    t[..., 0] = 65504
    t[..., 1] = -65504
    return t


def cases(first: bool):
    K = ("k", "key_states", "keys", "key", "tokens", "token")
    out = [
        ("k:nan", lambda c: c.update(_nan(kv(3, 1)[0]), kv(3, 1)[1], 0), K, ERROR, None),
        (
            "k:other_head_dim",
            lambda c: c.update(torch.zeros(1, H, 3, D + 8), torch.zeros(1, H, 3, D + 8), 0),
            K + ("shape", "D"),
            ERROR,
            None,
        ),
        (
            "k:other_kv_heads",
            lambda c: c.update(torch.zeros(1, H + 1, 3, D), torch.zeros(1, H + 1, 3, D), 0),
            K + ("shape", "H_kv"),
            ERROR,
            None,
        ),
        ("k:3d", lambda c: c.update(torch.zeros(H, 3, D), torch.zeros(H, 3, D), 0), K + ("shape",), ERROR, None),
        (
            "k:numpy",
            lambda c: c.update(kv(3, 1)[0].numpy(), kv(3, 1)[1].numpy(), 0),
            K + ("tensor",),
            OK_OR_ERROR,
            lambda c: c.update(*kv(3, 1), 0),
        ),
        (
            "k:int",
            lambda c: c.update(torch.ones(1, H, 3, D, dtype=torch.int32), torch.ones(1, H, 3, D, dtype=torch.int32), 0),
            K + ("dtype",),
            ERROR,
            None,
        ),
        (
            "k:meta_device",
            lambda c: c.update(torch.zeros(1, H, 3, D, device="meta"), torch.zeros(1, H, 3, D, device="meta"), 0),
            K + ("device",),
            ERROR,
            None,
        ),
        (
            "k_v:T_mismatch",
            lambda c: c.update(torch.zeros(1, H, 3, D), torch.zeros(1, H, 4, D), 0),
            K + ("v", "value_states", "shape"),
            ERROR,
            None,
        ),
        ("k_v:over_capacity", lambda c: c.update(*kv(CAP + 1, 2), 0), K + ("max_tokens", "capacity"), ERROR, None),
        (
            "k_v:fp16_65504",
            lambda c: c.update(_extreme(kv(3, 1)[0]), _extreme(kv(3, 1)[1]), 0),
            K,
            OK_OR_ERROR,
            "finite",
        ),
        (
            "k_v:noncontig",
            lambda c: c.update(*(t.transpose(1, 2).contiguous().transpose(1, 2) for t in kv(3, 1)), 0),
            K,
            OK_OR_ERROR,
            lambda c: c.update(*kv(3, 1), 0),
        ),
    ]
    for bad in (True, -1, L, "0", 1.0, None):
        out.append(
            (f"layer_idx={bad!r}", lambda c, bad=bad: c.update(*kv(2, 3), bad), ("layer_idx", "layer"), ERROR, None)
        )
    if not first:
        out.append(("k:other_batch", lambda c: c.update(*kv(2, 3, B=2), 0), K + ("batch", "B"), ERROR, None))
    return out


@pytest.mark.parametrize("first", [True, False], ids=["first_update", "after_prefill"])
@pytest.mark.parametrize("name", NAMES)
def test_hf_cache_update(name, first):
    rec = Recorder("hf", f"make_cache({name}).update")
    B_next = 2 if first else 1  # a rejected first update must not fix the batch size
    for case, call, words, expect, canonical in cases(first):
        T0 = 0 if first else 20
        victim, twin = build(name, T0), build(name, T0)

        def oracle(result, canonical=canonical, victim=victim, twin=twin):
            if canonical == "finite":
                return all_finite(result)
            want = canonical(twin)
            why = results_close(result, want, rtol=0)
            if why:
                return f"result differs from the canonical call's: {why}"
            diff = snapshot_diff(snapshot(twin), snapshot(victim))
            return None if not diff else f"the cache differs from the canonical call's at {diff}"

        rec.call(
            case,
            lambda: call(victim),
            names=words,
            expect=expect,
            oracle=oracle,
            states=[victim],
            followup=lambda: followup(victim, twin, B_next),
        )
    rec.assert_clean()


def test_hf_fp16_model_never_gets_inf():
    """Item 4 end to end: an fp16 model's keys holding +-65504 come back finite from every method (or are
    refused with a clear error)."""
    rec = Recorder("hf", "make_cache(*).update fp16 65504")
    for name in NAMES:
        cache = build(name, 0)
        k, v = kv(20, 4)
        for l in range(L):
            rec.call(
                f"{name}: fp16 keys with +-65504, layer {l}",
                lambda l=l: cache.update(_extreme(k), _extreme(v), l),
                names=("k", "key_states", "keys", "tokens", "token"),
                expect=OK_OR_ERROR,
                oracle=all_finite,
                states=[cache],
            )
    rec.assert_clean()


def _ctor_cases(name):
    out = []
    for bad in (0, -1, True, "8", 2.5):
        out.append((f"max_tokens={bad!r}", dict(max_tokens=bad), ("max_tokens",)))
    out += [
        ("backend='bogus'", dict(backend="bogus"), ("backend",)),
        ("override bogus_field", dict(bogus_field=1), ("bogus_field", "option")),
        ("model_or_config='x'", dict(model_or_config="x"), ("model", "config", "model_or_config")),
        ("model_or_config=None", dict(model_or_config=None), ("model", "config", "model_or_config")),
    ]
    if M.METHODS[name].calibration is None:
        out.append(("calibration='identity' (takes none)", dict(calibration="identity"), ("calibration",)))
    else:
        out.append(("calibration=None (needs one)", dict(calibration=None), ("calibration",)))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_hf_cache_constructor(name):
    rec = Recorder("hf", f"make_cache({name})")
    for case, change, words in _ctor_cases(name):
        kw = dict(backend="reference", calibration=calibration(name), max_tokens=CAP, **SMALL[name])
        model = change.pop("model_or_config", config()) if "model_or_config" in change else config()
        kw.update(change)
        rec.call(case, lambda kw=kw, model=model: make_cache(name, model, **kw), names=words, expect=ERROR)
    for bad in ("bogus", None, 5):
        rec.call(
            f"method={bad!r}", lambda bad=bad: make_cache(bad, config()), names=("method", "method_name"), expect=ERROR
        )
    cache = build(name, 3)
    for case, call in (
        ("crop", lambda: cache.crop(1)),
        ("reorder_cache", lambda: cache.reorder_cache(torch.zeros(1))),
        ("batch_repeat_interleave", lambda: cache.batch_repeat_interleave(2)),
    ):
        rec.call(case, call, names=("crop", "cropped", "beam", "re-indexing"), expect=ERROR, states=[cache])
    rec.assert_clean()
