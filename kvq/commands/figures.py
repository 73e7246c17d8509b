"""``kvq figures``: write every figure of ``kvq.viz`` as a PNG, drawn on the inputs the book draws it on.

Each figure of the book chapters (``book/*.md``) is rebuilt here from the same synthetic data of the
reference tier: the KIVI chapter's keys with three outlier channels, the Kitty chapter's keys and small
paged cache, the OSCAR chapter's planted layer (queries with a decaying spectrum, keys with outlier
channels, GQA 4:1), the AQUA-KV chapter's tiny seeded NumPy decoder (``kvq.reference.model``), the HIGGS
grids, and BitDecoding's fragment / packing / warp schematics. ``--source minilm`` draws the channel
magnitude, group-range and OSCAR rotated-group figures from REAL activations instead: the keys and
queries of the sentence-transformer all-MiniLM-L6-v2 (``kvq.integrations.models.load_minilm``) on real
English text (``kvq.integrations.text.english_texts``), captured with ``kvq.integrations.capture``.

    kvq figures --out figures/                               # every synthetic figure
    kvq figures --only spectra,token_groups --json           # two of them; JSON list of the files
    kvq figures --source minilm --out figures/               # real MiniLM keys (offline)

Figures are drawn with matplotlib's Agg canvas (``kvq.viz`` never touches pyplot) and written as
``<name>.png`` (``minilm_<name>.png`` for the MiniLM source).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import struct
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["FigureSpec", "FIGURES", "SOURCES", "SyntheticInputs", "MiniLMInputs", "figure_names", "select", "draw",
           "png_size", "write_figures", "minilm_activations", "outlier_score", "build_parser", "validate", "main"]

SOURCES = ("synthetic", "minilm")


@dataclass(frozen=True)
class FigureSpec:
    """One figure: its ``name`` (the file stem), the ``source`` of its data, the ``kvq.viz`` functions it
    calls, the book ``chapter`` it comes from, a one-line ``summary`` and ``draw(inputs) -> Figure``."""

    name: str
    source: str
    functions: tuple
    chapter: str
    summary: str
    draw: Callable

    @property
    def filename(self) -> str:
        """The PNG file name: ``<name>.png``, prefixed ``minilm_`` for the MiniLM source."""
        return f"{self.name}.png" if self.source == "synthetic" else f"{self.source}_{self.name}.png"


# ---------------------------------------------------------------------------------------------------
# inputs: the book's synthetic data (computed once, on first use)


class SyntheticInputs:
    """The data each book chapter draws its figures on, built lazily (each property once)."""

    @functools.cached_property
    def kivi_keys(self) -> np.ndarray:
        """book/kivi.md: (1, 1, 512, 128) fp16 keys, channels 7, 42, 99 scaled by 15 and shifted by 6."""
        rng = np.random.default_rng(0)
        T, D = 512, 128
        k = rng.standard_normal((1, 1, T, D)).astype(np.float32)
        outliers = [7, 42, 99]
        k[..., outliers] = k[..., outliers] * 15 + 6
        return k.astype(np.float16)

    @functools.cached_property
    def kitty(self) -> dict:
        """book/kitty.md: keys (1, 1, 256, 64) fp16 with channels 5, 17, 40 scaled; queries (1, 4, 256, 64);
        values (1, 1, 256, 64) fp16 (drawn after the queries, as in the chapter)."""
        rng = np.random.default_rng(0)
        H_q, T, D = 4, 256, 64
        k = rng.standard_normal((1, 1, T, D)).astype(np.float32)
        k[..., [5, 17, 40]] *= np.array([12.0, 6.0, 9.0], np.float32)
        k = k.astype(np.float16)
        q = rng.standard_normal((1, H_q, T, D)).astype(np.float32)
        v = rng.standard_normal((1, 1, T, D)).astype(np.float16)
        return {"q": q, "k": k, "v": v, "T": T, "D": D}

    @functools.cached_property
    def oscar_layer(self) -> dict:
        """book/oscar.md: the planted layer q (1, 8, 1024, 128), k, v (1, 2, 1024, 128) fp32, its target
        covariances and eigenbases."""
        from kvq.reference import rotations as rot

        rng = np.random.default_rng(0)
        B, H_q, H_kv, T, D = 1, 8, 2, 1024, 128
        O_Q, O_K, O_V = (rot.random_orthogonal(D, rng) for _ in range(3))
        j = np.arange(D)
        q = (rng.standard_normal((B, H_q, T, D)) * (2.0 / (1 + j) ** 0.7)) @ O_Q      # a few dominant directions
        k = (rng.standard_normal((B, H_kv, T, D)) * (1.5 / (1 + j / 4) ** 0.5)) @ O_K
        k = k + 0.5 * q[:, ::H_q // H_kv]                                              # keys that queries find
        outliers = rng.choice(D, 3, replace=False)
        k[..., outliers] = k[..., outliers] * 6.0 + np.array([4.0, -3.0, 2.5])         # outlier key channels
        v = (rng.standard_normal((B, H_kv, T, D)) / (1 + j / 4) ** 0.7) @ O_V
        v[..., rng.choice(D, 2, replace=False)] *= 5.0
        q, k, v = (a.astype(np.float32) for a in (q, k, v))
        cov = rot.target_covariances(q, k, v)
        lam_Q, U_Q = rot.eig_desc(cov["C_Q"])
        lam_K, U_K = rot.eig_desc(cov["C_K"])
        return {"q": q, "k": k, "v": v, "D": D, "G": 64, "cov": cov, "lam_Q": lam_Q, "U_Q": U_Q, "lam_K": lam_K,
                "U_K": U_K}

    @functools.cached_property
    def oscar_methods(self) -> dict:
        """book/oscar.md: the calibrations compared in Figs. 2 / 8 (naive INT2 ... raw-cache target)."""
        from kvq.reference import oscar

        L = self.oscar_layer
        q, k, v, D, cov = L["q"], L["k"], L["v"], L["D"], L["cov"]
        return {
            "naive INT2": oscar.identity_calibration(D),
            "Hadamard": oscar.calibrate(q, k, v, rotation="hadamard", clip=(1.0, 1.0), targets=cov),
            "clip only": oscar.identity_calibration(D, 0.96, 0.92),
            "U_Q H": oscar.calibrate(q, k, v, rotation="eigen_hadamard", targets=cov),
            "OSCAR": oscar.calibrate(q, k, v, targets=cov),
            "K^TK / V^TV target": oscar.calibrate(q, k, v, target="tensor", targets=cov),
        }

    @functools.cached_property
    def aqua(self) -> dict:
        """book/aqua.md: the 6-layer tiny decoder's K / V on 4 training and 2 test sequences of 256 tokens."""
        from kvq.reference import model as M

        tiny = M.TinyDecoder(M.ModelConfig(n_layers=6, seed=0))
        train = M.collect_kv(tiny, M.sample_tokens(tiny.cfg, 4, 256, seed=1))
        test = M.collect_kv(tiny, M.sample_tokens(tiny.cfg, 2, 256, seed=2))
        return {"train": train, "test": test}


# ---------------------------------------------------------------------------------------------------
# the synthetic figures, as the chapters call them


def _channel_magnitudes(x: SyntheticInputs):
    from kvq.viz import plot_channel_magnitudes

    return plot_channel_magnitudes(x.kivi_keys[0, 0].astype(np.float32), title="synthetic keys: three outlier channels")


def _group_ranges(x: SyntheticInputs):
    from kvq.viz import plot_group_ranges

    k = x.kivi_keys[0, 0].astype(np.float32)                                        # (T, D)
    fig = plot_group_ranges(k, group_size=128, axis=-1, label="per token (groups of 128 channels)")
    plot_group_ranges(k, group_size=128, axis=0, ax=fig.axes[0], label="per channel (groups of 128 tokens)")
    return fig


def _channel_sensitivity(x: SyntheticInputs):
    from kvq.reference import kitty
    from kvq.viz import plot_channel_sensitivity

    d = x.kitty
    mse = kitty.channel_sensitivity(d["q"], d["k"], group_size=128)                 # (H_q, D)
    return plot_channel_sensitivity(mse, top=3, title="attention-score MSE per INT2 channel")


def _page_layout(x: SyntheticInputs):
    from kvq.reference import kitty
    from kvq.reference.packing import unpack
    from kvq.viz import plot_page_layout

    k = x.kitty["k"]
    small = kitty.KittyConfig(0.25, group_size=16, residual=8, sink=4, max_tokens=64)
    st = kitty.init(small, batch=1, kv_heads=1, head_dim=16)
    kitty.append(small, st, k[:, :, :40, :16], k[:, :, :40, :16])
    pid = st.k_table[0, 0]                                                          # sequence 0, page 0
    pool = {name: a[pid, 0] for name, a in st.k_pool.items()}                       # KV head 0
    return plot_page_layout(unpack(pool["low"], 2, axis=-1), unpack(pool["high"], 2, axis=-1), pool["idx"],
                            pool["scale"], pool["mn"])


def _error_vs_boost(x: SyntheticInputs):
    from kvq.reference import kitty
    from kvq.viz import plot_error_vs_boost

    d = x.kitty
    k, v, T, D = d["k"], d["v"], d["T"], d["D"]
    rates = [0.0, 0.0625, 0.125, 0.25, 0.5]
    errors = []
    for selection in ("magnitude", "random"):
        row = []
        for r in rates:
            cfg = kitty.KittyConfig(r, selection=selection, sink=0, residual=0, max_tokens=T)
            K, _ = kitty.dequantize(cfg, kitty.append(cfg, kitty.init(cfg, 1, 1, D), k, v))
            row.append(float(np.mean((K - k.astype(np.float32)) ** 2)))
        errors.append(row)
    return plot_error_vs_boost(rates, np.array(errors), labels=["magnitude (Kitty)", "random channels"],
                               ylabel="key MSE")


def _spectra(x: SyntheticInputs):
    from kvq.reference import rotations as rot
    from kvq.viz import plot_spectra

    L = x.oscar_layer
    return plot_spectra({"C_Q = Q^T Q / N": L["lam_Q"], "C_K = K^T K / N": L["lam_K"],
                         "C_S": rot.eig_desc(L["cov"]["C_S"])[0]})


def _alignment(x: SyntheticInputs):
    from kvq.viz import plot_alignment

    L = x.oscar_layer
    return plot_alignment(L["U_Q"], L["U_K"], top=32)


_ROTATIONS = ("identity", "hadamard", "eigen", "eigen_hadamard", "oscar")


def _token_groups_of(k_t, U_Q, group_size: int, title: str):
    """One token's keys under each rotation of OSCAR's Table 10 (``rotations.compose`` of ``U_Q``)."""
    from kvq.reference import rotations as rot
    from kvq.viz import plot_token_groups

    R = {name: rot.compose(name, U_Q) for name in _ROTATIONS}
    return plot_token_groups({name: np.asarray(k_t, np.float64) @ R[name] for name in _ROTATIONS},
                             group_size=group_size, title=title)


def _token_groups(x: SyntheticInputs):
    L = x.oscar_layer
    t = 5                                                                           # one token of KV head 0
    return _token_groups_of(L["k"][0, 0, t], L["U_Q"], L["G"],
                            f"synthetic OSCAR layer: key of token {t} under each rotation (groups of {L['G']})")


def _error_table(x: SyntheticInputs):
    from kvq.reference import rotations as rot
    from kvq.viz import plot_error_table

    L = x.oscar_layer
    errors = rot.error_table(L["q"][:, :, -256:], L["k"], L["v"], x.oscar_methods, group_size=L["G"])
    return plot_error_table(errors)


def _kl_vs_context(x: SyntheticInputs):
    from kvq.reference import metrics
    from kvq.reference import rotations as rot
    from kvq.viz import plot_kl_vs_context

    L = x.oscar_layer
    q, k, G = L["q"], L["k"], L["G"]
    lengths = [128, 256, 512, 1024]
    names = ["naive INT2", "Hadamard", "OSCAR"]
    kl = []
    for name in names:
        c = x.oscar_methods[name]
        k_hat = rot.fake_quantize(k, c.R_K, c.clip_k, G)
        kl.append([metrics.attention_kl(q[:, :, n - 16:n], k[:, :, :n], k_hat[:, :, :n], causal=True)
                   for n in lengths])
    return plot_kl_vs_context(lengths, np.array(kl), labels=names)


def _explained_variance(x: SyntheticInputs):
    from kvq.reference import aqua as A
    from kvq.reference import aqua_probes as PR
    from kvq.viz import plot_explained_variance

    probes = PR.probe_explained_variance(A.AquaConfig(), x.aqua["train"], x.aqua["test"], depth=3)
    return plot_explained_variance(probes, title="linear probes on the tiny model (keys pre-RoPE)")


def _residual_variance(x: SyntheticInputs):
    from kvq.reference import aqua as A
    from kvq.reference import aqua_probes as PR
    from kvq.reference import higgs as Hg
    from kvq.viz import plot_residual_variance

    def higgs(n, d=2):
        return A.Higgs(Hg.HiggsConfig(d, n, group_size=64))                        # one group per token

    cfg = A.AquaConfig(backbone=higgs(16), first_layer=higgs(256))                  # 2-bit residuals, 4-bit layer 0
    P = A.calibrate(cfg, x.aqua["train"])
    before, after = PR.residual_variance(cfg, P, x.aqua["test"])
    return plot_residual_variance(before, after, title="what the backbone has to quantize, per layer")


def _higgs_grids(x: SyntheticInputs):
    from kvq.reference import higgs as Hg
    from kvq.viz import plot_higgs_grid
    from kvq.viz.common import new_figure

    fig = new_figure(figsize=(9, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    plot_higgs_grid(Hg.load_grid(2, 16), ax=ax1)
    plot_higgs_grid(Hg.load_grid(2, 256), ax=ax2)
    return fig


def _fragment_layout(operand: str):
    def draw_(x: SyntheticInputs):
        from kvq.viz import plot_fragment_layout

        return plot_fragment_layout(operand)
    return draw_


def _small_bitdecoding():
    from kvq.reference import bitdecoding as bd

    return bd.BitDecodingConfig(bits=4, warps_n=1, k_group=32, v_group=32)         # N_r = 32, the chapter's


def _induced_packing(tensor: str):
    def draw_(x: SyntheticInputs):
        from kvq.viz import plot_induced_packing

        return plot_induced_packing(_small_bitdecoding(), tensor, lane=5)
    return draw_


def _warp_partition(x: SyntheticInputs):
    from kvq.viz import plot_warp_partition

    return plot_warp_partition(warps_n=4, tile_n=64)


# ---------------------------------------------------------------------------------------------------
# MiniLM: real activations


@dataclass
class MiniLMInputs:
    """Real activations of all-MiniLM-L6-v2 on English text, and the (layer, head) the figures show.

    ``records``: ``capture_qkv``'s list of per-layer dicts {"q", "k", "v"} (1, 12, T, 32) float32;
    ``layer`` / ``head``: given, or (None) the pair whose keys have the most pronounced outlier channel
    (largest max / median over channels of the mean |k|, Kitty's Eq. 2 score); ``n_chars`` / ``tokens``:
    how much text was fed.
    """

    records: list
    layer: int
    head: int
    tokens: int
    n_chars: int

    @property
    def k(self) -> np.ndarray:
        """(T, D) keys of the chosen layer and head."""
        return self.records[self.layer]["k"][0, self.head]

    @property
    def q(self) -> np.ndarray:
        """(T, D) queries of the chosen layer and head (MiniLM has no GQA: query head = key head)."""
        return self.records[self.layer]["q"][0, self.head]

    @property
    def where(self) -> str:
        return f"MiniLM layer {self.layer}, head {self.head}, {self.tokens} tokens of English text"


def outlier_score(k) -> float:
    """max / median over channels of the mean |k| over tokens (k: (T, D)); large = a dominant channel."""
    s = np.abs(np.asarray(k, np.float64)).mean(axis=0)                              # (D,) Kitty Eq. 2
    med = float(np.median(s))
    return float(s.max() / med) if med > 0 else float("inf")


def minilm_activations(max_chars: int = 4000, max_tokens: int = 256, layer=None, head=None, *,
                       progress: bool = True) -> MiniLMInputs:
    """Capture MiniLM's per-layer Q, K, V on the first ``max_chars`` characters of real English text
    (``english_texts``), tokenized and cut to ``max_tokens`` (at most 512, BERT's positions).
    ``progress=False`` also silences transformers' weight-loading bar."""
    from kvq.integrations.capture import capture_qkv
    from kvq.integrations.models import load_minilm
    from kvq.integrations.text import english_texts

    if not 8 <= max_tokens <= 512:
        raise ValueError(f"--minilm-tokens must be in [8, 512] (MiniLM has 512 positions); got {max_tokens}")
    texts = english_texts(max_chars)
    text = " ".join(texts)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress and bars:
        hf_logging.disable_progress_bar()
    try:
        model, tok = load_minilm()
    finally:
        if not progress and bars:                                   # leave transformers as it was
            hf_logging.enable_progress_bar()
    ids = tok(text, return_tensors="np", truncation=True, max_length=max_tokens)["input_ids"]   # (1, T)
    if ids.shape[1] < 8:
        raise ValueError(f"only {ids.shape[1]} tokens from {len(text)} characters; raise --minilm-chars")
    records = capture_qkv(model, ids)
    L, H = len(records), records[0]["k"].shape[1]
    for name, v, n in (("--layer", layer, L), ("--head", head, H)):
        if v is not None and not 0 <= v < n:
            raise ValueError(f"{name}={v} is out of range: MiniLM has {n} {'layers' if name == '--layer' else 'heads'}")
    if layer is None or head is None:
        cands = [(outlier_score(records[l]["k"][0, h]), l, h) for l in range(L) for h in range(H)
                 if (layer is None or l == layer) and (head is None or h == head)]
        _, layer, head = max(cands)
    return MiniLMInputs(records, int(layer), int(head), int(ids.shape[1]), len(text))


def _minilm_channel_magnitudes(x: MiniLMInputs):
    from kvq.viz import plot_channel_magnitudes

    return plot_channel_magnitudes(x.k, title=f"real keys: {x.where}")


def _minilm_group_ranges(x: MiniLMInputs):
    from kvq.viz import plot_group_ranges

    k = x.k                                                                         # (T, D = 32)
    D = k.shape[1]
    T = k.shape[0] - k.shape[0] % D                                                 # whole groups of D tokens
    fig = plot_group_ranges(k[:T], group_size=D, axis=-1, label=f"per token (groups of {D} channels)")
    plot_group_ranges(k[:T], group_size=D, axis=0, ax=fig.axes[0], label=f"per channel (groups of {D} tokens)")
    fig.axes[0].set_title(f"real keys: {x.where}", fontsize=9)
    return fig


def _minilm_token_groups(x: MiniLMInputs):
    from kvq.reference import rotations as rot

    q, k = x.q[None, None], x.k[None, None]                                         # (1, 1, T, D)
    v = x.records[x.layer]["v"][0, x.head][None, None]
    cov = rot.target_covariances(q, k, v, scale=x.records[x.layer].get("scaling"))
    _, U_Q = rot.eig_desc(cov["C_Q"])
    D = k.shape[-1]
    G = max(1, D // 4)                                                              # 4 groups per token
    t = min(5, k.shape[2] - 1)
    return _token_groups_of(k[0, 0, t], U_Q, G, f"real key of token {t} under each rotation (groups of {G})\n"
                            f"{x.where}")


# ---------------------------------------------------------------------------------------------------
# the registry


def _spec(name, source, functions, chapter, summary, draw_) -> FigureSpec:
    return FigureSpec(name, source, tuple(functions), chapter, summary, draw_)


FIGURES: dict = {(s.source, s.name): s for s in (
    _spec("channel_magnitudes", "synthetic", ["plot_channel_magnitudes"], "kivi",
          "|k| per token and channel with the per-channel strip (Kitty Fig. 2a)", _channel_magnitudes),
    _spec("group_ranges", "synthetic", ["plot_group_ranges"], "kivi",
          "per-token vs per-channel group ranges of the same keys (KIVI section 3.1)", _group_ranges),
    _spec("channel_sensitivity", "synthetic", ["plot_channel_sensitivity"], "kitty",
          "attention-score MSE when one channel is INT2 (Kitty Fig. 2b)", _channel_sensitivity),
    _spec("page_layout", "synthetic", ["plot_page_layout"], "kitty",
          "one Kitty key page: two 2-bit planes and the index (Kitty Fig. 3a)", _page_layout),
    _spec("error_vs_boost", "synthetic", ["plot_error_vs_boost"], "kitty",
          "key MSE against the boosted fraction, magnitude vs random channels", _error_vs_boost),
    _spec("spectra", "synthetic", ["plot_spectra"], "oscar",
          "eigenvalue spectra of C_Q, C_K, C_S (OSCAR Fig. 7)", _spectra),
    _spec("alignment", "synthetic", ["plot_alignment"], "oscar",
          "|U_Q^T U_K|: query and key eigenbases (OSCAR Fig. 7)", _alignment),
    _spec("token_groups", "synthetic", ["plot_token_groups"], "oscar",
          "one key under each rotation, group ranges written (OSCAR Table 10 / Fig. 1)", _token_groups),
    _spec("error_table", "synthetic", ["plot_error_table"], "oscar",
          "attention errors per rotation relative to naive INT2 (OSCAR Figs. 2 / 8)", _error_table),
    _spec("kl_vs_context", "synthetic", ["plot_kl_vs_context"], "oscar",
          "attention KL against context length (OSCAR Fig. 3)", _kl_vs_context),
    _spec("explained_variance", "synthetic", ["plot_explained_variance"], "aqua",
          "linear probes' explained variance on the tiny decoder (AQUA-KV Fig. 2)", _explained_variance),
    _spec("residual_variance", "synthetic", ["plot_residual_variance"], "aqua",
          "variance per layer before / after the AQUA-KV predictors", _residual_variance),
    _spec("higgs_grids", "synthetic", ["plot_higgs_grid"], "aqua",
          "the d = 2 HIGGS grids with 16 and 256 points over N(0, I)", _higgs_grids),
    _spec("fragment_layout_a", "synthetic", ["plot_fragment_layout"], "bitdecoding",
          "mma.m16n8k16 register fragments of A (BitDecoding Fig. 3a)", _fragment_layout("a")),
    _spec("fragment_layout_b", "synthetic", ["plot_fragment_layout"], "bitdecoding",
          "mma.m16n8k16 register fragments of B (BitDecoding Fig. 3a)", _fragment_layout("b")),
    _spec("fragment_layout_c", "synthetic", ["plot_fragment_layout"], "bitdecoding",
          "mma.m16n8k16 accumulator fragments C / D", _fragment_layout("c")),
    _spec("induced_packing_k", "synthetic", ["plot_induced_packing"], "bitdecoding",
          "the induced low-bit packing of one lane's keys (BitDecoding Fig. 5)", _induced_packing("k")),
    _spec("induced_packing_v", "synthetic", ["plot_induced_packing"], "bitdecoding",
          "the induced low-bit packing of one lane's values (ldmatrix.trans)", _induced_packing("v")),
    _spec("warp_partition", "synthetic", ["plot_warp_partition"], "bitdecoding",
          "warps along N, sTMP and sAcc (BitDecoding Fig. 6 / Algorithm 1)", _warp_partition),
    _spec("channel_magnitudes", "minilm", ["plot_channel_magnitudes"], "kivi",
          "|k| per token and channel of REAL MiniLM keys", _minilm_channel_magnitudes),
    _spec("group_ranges", "minilm", ["plot_group_ranges"], "kivi",
          "per-token vs per-channel group ranges of REAL MiniLM keys", _minilm_group_ranges),
    _spec("token_groups", "minilm", ["plot_token_groups"], "oscar",
          "one REAL MiniLM key under each rotation, U_Q from its queries", _minilm_token_groups),
)}


def figure_names(source: str = "synthetic") -> list:
    """The figure names of ``source``, in drawing order."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; sources: {', '.join(SOURCES)}")
    return [name for (src, name) in FIGURES if src == source]


def select(source: str, only=None) -> list:
    """The specs to draw: all of ``source``, or those named in ``only`` (a list of names, in that order).
    ValueError naming the unknown names and listing the valid ones."""
    names = figure_names(source)
    if not only:
        return [FIGURES[source, n] for n in names]
    wanted = list(dict.fromkeys(only))
    unknown = [n for n in wanted if n not in names]
    if unknown:
        other = [n for n in unknown if any((s, n) in FIGURES for s in SOURCES if s != source)]
        hint = (f" ({', '.join(other)} {'is' if len(other) == 1 else 'are'} not drawn from the {source} source)"
                if other else "")
        raise ValueError(f"unknown figure{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                         f"--source {source}{hint}; figures: {', '.join(names)}")
    return [FIGURES[source, n] for n in wanted]


def draw(spec: FigureSpec, inputs):
    """The ``matplotlib.figure.Figure`` of ``spec`` on ``inputs`` (SyntheticInputs or MiniLMInputs)."""
    return spec.draw(inputs)


def png_size(path) -> tuple:
    """(width, height) in pixels from a PNG file's IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def write_figures(specs, inputs, out_dir, *, dpi: int = 120, progress: bool = True) -> list:
    """Draw and save each spec into ``out_dir``; returns [{name, source, path, width, height}]."""
    from tqdm.auto import tqdm

    os.makedirs(out_dir, exist_ok=True)
    rows = []
    bar = tqdm(specs, desc="figures", unit="fig", disable=not progress, file=sys.stderr)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        fig = draw(spec, inputs)
        path = os.path.join(out_dir, spec.filename)
        fig.savefig(path, dpi=dpi)
        fig.clear()
        w, h = png_size(path)
        rows.append({"name": spec.name, "source": spec.source, "path": path, "width": int(w), "height": int(h)})
    return rows


# ---------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq figures`` argument parser."""
    from kvq.commands import Parser, int_in, non_negative_int, positive_int

    p = Parser(
        prog="kvq figures",
        description="Write kvq.viz's figures as PNG files, drawn on the book's inputs (synthetic data of the "
                    "reference tier) or, with --source minilm, on real MiniLM activations.",
        epilog="figures (synthetic): " + ", ".join(figure_names("synthetic"))
               + "; figures (minilm): " + ", ".join(figure_names("minilm")))
    p.add_argument("--out", default="figures", help="output directory (default: figures/)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="comma-separated figure names to draw (default: every figure of the source)")
    p.add_argument("--source", default="synthetic", choices=SOURCES,
                   help="synthetic: the book's inputs; minilm: real keys of all-MiniLM-L6-v2 on English text")
    p.add_argument("--list", action="store_true", help="list the figures (both sources) and exit")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of {name, source, path, width, height} (with --list: the registry)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dpi", type=int_in(10, 1200), default=120, help="PNG resolution, 10..1200 (default 120)")
    g = p.add_argument_group("minilm source")
    g.add_argument("--minilm-chars", type=positive_int, default=4000,
                   help="characters of English text fed to MiniLM (default 4000)")
    g.add_argument("--minilm-tokens", type=int_in(8, 512, " (MiniLM has 512 positions)"), default=256,
                   help="tokens kept, 8..512 (default 256)")
    g.add_argument("--layer", type=non_negative_int, default=None,
                   help="MiniLM layer to draw (default: the layer/head with the strongest outlier channel)")
    g.add_argument("--head", type=non_negative_int, default=None,
                   help="MiniLM attention head to draw (default: as --layer)")
    return p


def validate(args) -> list:
    """The specs to draw, every argument checked before anything is drawn or loaded: ``--only`` names,
    ``--out`` a writable directory, ``--layer`` / ``--head`` within MiniLM's layers and heads (its
    config.json). ``kvq.commands.CommandError``."""
    from kvq.commands import CommandError, check_out_dir, model_config, usage_errors

    prog = "kvq figures"
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only is not None and not only:
        raise CommandError("--only names no figure; see `kvq figures --list`", prog)
    with usage_errors(prog):
        specs = select(args.source, only)
        check_out_dir(args.out, prog=prog)
    if args.source == "minilm" and (args.layer is not None or args.head is not None):
        from kvq.integrations.models import minilm_path

        with usage_errors(prog):
            conf = model_config(minilm_path()) or {}
        for option, v, key, what in (("--layer", args.layer, "num_hidden_layers", "layers"),
                                     ("--head", args.head, "num_attention_heads", "heads")):
            n = conf.get(key)
            if v is not None and isinstance(n, int) and v >= n:
                raise CommandError(f"{option}={v} is out of range: MiniLM has {n} {what}", prog)
    return specs


def _list(as_json: bool) -> None:
    specs = list(FIGURES.values())
    if as_json:
        print(json.dumps([{"name": s.name, "source": s.source, "file": s.filename, "functions": list(s.functions),
                           "chapter": s.chapter, "summary": s.summary} for s in specs], indent=1))
        return
    for source in SOURCES:
        print(f"{source}:")
        for s in specs:
            if s.source == source:
                print(f"  {s.name:20s} {s.chapter:12s} {s.summary}")


def main(argv=None) -> int:
    """``kvq figures [--out DIR] [--only NAMES] [--source synthetic|minilm] [--list] [--json]``; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                                 # --help (0) or a usage error (2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.list:
        _list(args.json)
        return 0
    from kvq.commands import CommandError, report

    try:
        specs = validate(args)
    except CommandError as e:
        return report(e)
    try:
        if args.source == "minilm":
            inputs = minilm_activations(args.minilm_chars, args.minilm_tokens, args.layer, args.head,
                                        progress=not args.quiet)
        else:
            inputs = SyntheticInputs()
        rows = write_figures(specs, inputs, args.out, dpi=args.dpi, progress=not args.quiet)
    except (ValueError, ImportError, RuntimeError, OSError) as e:
        print(f"kvq figures: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['path']}  ({r['width']} x {r['height']})")
    return 0


if __name__ == "__main__":
    from kvq.cli import main as _cli

    raise SystemExit(_cli(["figures", *sys.argv[1:]]))
