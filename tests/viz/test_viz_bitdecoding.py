"""kvq.viz.bitdecoding: the induced-packing figure (Fig. 5) highlights exactly the cells one lane holds,
coloured by the word the layout of ``kvq.reference.bitdecoding`` packs them into; the warp-partition
schematic (Fig. 6) has one slice per warp; both draw into given Axes, refuse bad arguments, and never
import matplotlib.pyplot (checked in a fresh interpreter)."""

import io
import re

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from kvq.reference import bitdecoding as bd  # noqa: E402
from kvq.reference import fragments as fr  # noqa: E402
from kvq.viz import plot_fragment_layout, plot_induced_packing, plot_warp_partition  # noqa: E402
from kvq.viz.common import new_figure  # noqa: E402
from kvq.viz.bitdecoding import lane_cells  # noqa: E402

from ._fresh import run_fresh  # noqa: E402

EMPTY = np.array([0xEE, 0xEE, 0xEE]) / 255


def cfg(bits=4, warps_n=1):
    n_r = bd.residual_block_size(bits, warps_n)
    return bd.BitDecodingConfig(bits=bits, warps_n=warps_n, k_group=n_r, v_group=32)


CONFIGS = [cfg(4, 1), cfg(2, 1), cfg(4, 2)]


def png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=30)
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def panels(fig):
    host = fig.axes[0]
    tile, words = host.child_axes
    return tile, words


def held(ax):
    """Boolean (rows, cols): the cells of an image panel that are not the background grey."""
    rgb = np.asarray(ax.images[0].get_array(), dtype=float)
    return ~np.all(np.isclose(rgb, EMPTY), axis=-1)


# ---------------------------------------------------------------------------------------------------
# lane_cells: the layout, derived from ldmatrix, equals the reference's pack / unpack


@pytest.mark.parametrize("c", CONFIGS, ids=lambda c: f"{c.bits}b-W{c.warps_n}")
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_lane_cells_match_unpacking(c, tensor):
    """Setting one slot of one word and unpacking it with the reference gives exactly the cell
    lane_cells names; over all 32 lanes every cell of the slice appears once."""
    seen = []
    for lane in range(fr.LANES):
        cells = lane_cells(c, tensor, lane)
        for t, ch, wr, wc, i in cells:
            if tensor == "k":
                W = np.zeros((8 * c.warps_n, 32), np.uint16)
                W[wr, wc] = 1 << (c.bits * i)
                codes = bd.unpack_keys(c, W)
            else:
                W = np.zeros((c.n_r, 8), np.uint16)
                W[wr, wc] = 1 << (c.bits * i)
                codes = bd.unpack_values(c, W)
            assert np.argwhere(codes).tolist() == [[t, ch]]
        seen += [(int(t), int(ch)) for t, ch in cells[:, :2]]
    width = 32 if tensor == "k" else 8 * c.per_word
    assert sorted(seen) == [(t, ch) for t in range(c.n_r) for ch in range(width)]


def test_lane_cells_sizes():
    c = cfg(4, 1)
    k = lane_cells(c, "k", 5)
    assert k.shape == (8 * c.per_word, 5)                       # ldmatrix.x4: 4 registers x 2 halves, R tiles
    g, tig = 5 >> 2, 5 % 4                                      # lane 5 holds row g, columns 2 tig, 2 tig + 1
    assert set(k[:, 0] % 8) == {g} and set(k[:, 1] % 8) == {2 * tig, 2 * tig + 1}
    v = lane_cells(c, "v", 5)
    assert v.shape == (4 * c.per_word * c.n_r // 16, 5)         # ldmatrix.x2.trans per 16-token k-tile
    assert set(v[:, 1] % 8) == {g} and set(v[:, 0] % 8) == {2 * tig, 2 * tig + 1}


# ---------------------------------------------------------------------------------------------------
# plot_induced_packing


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_induced_packing_default(tensor):
    fig = plot_induced_packing(tensor=tensor)
    assert isinstance(fig, Figure)
    tile, words = panels(fig)
    c = cfg(4, 1)                                               # the default: N_r = 32
    R = c.per_word
    frag = 8 if tensor == "k" else 4 * c.n_r // 16              # values lane 5 receives per R tiles
    mask = held(tile)
    assert mask.shape == ((32, 32) if tensor == "k" else (32, 8 * R))
    assert mask.sum() == frag * R == 32                         # the lane's fragment x R codes per word
    cells = lane_cells(None, tensor, 5)
    assert set(zip(*np.nonzero(mask))) == {(int(t), int(ch)) for t, ch in cells[:, :2]}
    assert held(words).sum() == frag                            # one word per fragment element
    digits = [t for t in tile.texts if re.fullmatch(r"\d", t.get_text())]
    assert len(digits) == frag * R
    assert sorted(int(t.get_text()) for t in digits) == sorted(np.repeat(np.arange(R), frag).tolist())
    # a cell and its word share a colour
    t, ch, wr, wc, _ = cells[0]
    rgb_t, rgb_w = (np.asarray(p.images[0].get_array()) for p in (tile, words))
    assert np.allclose(rgb_t[t, ch], rgb_w[wr, wc])
    png(fig)


@pytest.mark.parametrize("c", CONFIGS[1:], ids=["2b-W1", "4b-W2"])
def test_induced_packing_other_configs(c):
    for tensor in "kv":
        for lane in (0, 31):
            tile, words = panels(plot_induced_packing(c, tensor, lane=lane))
            assert held(tile).sum() == lane_cells(c, tensor, lane).shape[0]
            assert held(words).sum() == lane_cells(c, tensor, lane).shape[0] // c.per_word


def test_induced_packing_given_axes():
    host = new_figure((14, 6))
    a, b = host.subplots(1, 2)
    assert plot_induced_packing(ax=a) is host
    assert plot_induced_packing(tensor="v", ax=b) is host
    assert len(a.child_axes) == 2 and len(b.child_axes) == 2


@pytest.mark.parametrize("kw,match", [({"cfg": "KC4"}, "cfg"), ({"tensor": "q"}, "tensor"),
                                      ({"tensor": None}, "tensor"), ({"lane": 32}, "lane"),
                                      ({"lane": -1}, "lane"), ({"lane": 1.0}, "lane"), ({"lane": True}, "lane")])
def test_induced_packing_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        plot_induced_packing(**kw)
    with pytest.raises(ValueError, match=match):
        lane_cells(**kw)


# ---------------------------------------------------------------------------------------------------
# plot_warp_partition


@pytest.mark.parametrize("warps_n,tile_n", [(4, 64), (1, 64), (16, 128)])
def test_warp_partition(warps_n, tile_n):
    fig = plot_warp_partition(warps_n, tile_n)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    gids = [p.get_gid() for p in ax.patches if p.get_gid()]
    for kind in ("warp", "S", "sTMP"):
        assert sorted(g for g in gids if re.fullmatch(kind + r"\d+", g)) == sorted(f"{kind}{w}" for w in range(warps_n))
    assert gids.count("sAcc") == 1
    W = tile_n // warps_n
    slices = sorted((p for p in ax.patches if re.fullmatch(r"warp\d+", p.get_gid() or "")), key=lambda p: p.get_x())
    assert np.allclose([p.get_width() for p in slices], slices[0].get_width())   # equal slices
    texts = " ".join(t.get_text() for t in ax.texts)
    assert f"T_n = {tile_n} keys" in texts and f"{W} keys each" in texts
    if warps_n <= 8:
        assert f"keys {(warps_n - 1) * W}..{tile_n - 1}" in texts
    png(fig)


def test_warp_partition_given_axes():
    host = new_figure((10, 4))
    ax = host.subplots()
    assert plot_warp_partition(ax=ax) is host


@pytest.mark.parametrize("kw,match", [({"warps_n": 0}, "warps_n"), ({"warps_n": 3}, "multiple of warps_n"),
                                      ({"warps_n": 64, "tile_n": 128}, "at most 32"), ({"tile_n": 2.0}, "tile_n"),
                                      ({"warps_n": True}, "warps_n"), ({"tile_m": 0}, "tile_m")])
def test_warp_partition_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        plot_warp_partition(**kw)


def test_fragment_layout_exported():
    assert isinstance(plot_fragment_layout("b"), Figure)


def test_no_pyplot_imported():
    run_fresh("""
        import sys, io
        import kvq.viz.bitdecoding as v
        assert "matplotlib" not in sys.modules, "kvq.viz.bitdecoding imports matplotlib eagerly"
        v.plot_induced_packing().savefig(io.BytesIO(), format="png", dpi=20)
        v.plot_induced_packing(tensor="v").savefig(io.BytesIO(), format="png", dpi=20)
        v.plot_warp_partition().savefig(io.BytesIO(), format="png", dpi=20)
        bad = [m for m in ("matplotlib.pyplot", "torch") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
