"""kvq.viz: figures for the book and the benchmarks, drawn from plain NumPy arrays.

Every ``plot_*(data, ..., ax=None)`` returns a ``matplotlib.figure.Figure``. Without ``ax`` it makes a
new Figure with an Agg canvas; ``matplotlib.pyplot`` (and its global state) is never imported, nor is
torch. matplotlib itself is imported only when a function is called.

Every figure has a title (``title=`` where the function takes one, else a default; a title already on
a caller's Axes is kept), axis labels with units where the quantity has one, and any legend outside the
data area (``common.set_title`` / ``common.legend_outside``), so it covers nothing;
``tests/viz/test_figure_labels.py`` checks each function's figure for all three.

    from kvq.viz import plot_channel_magnitudes
    fig = plot_channel_magnitudes(k[0, 0], title="layer 10, KV head 0")   # k: (B, H_kv, T, D)
    fig.savefig("keys.png", dpi=150)

Modules: ``channels`` (Kitty section 3.2, Figures 2a/2b, boost-rate curves), ``page_layout`` (Kitty
section 4.1, Figure 3a), ``groups`` (per-token vs per-channel group ranges, KIVI section 3.1), ``aqua`` (AQUA-KV Fig. 2
probes, HIGGS grids, residual variance per layer), ``oscar`` (OSCAR Table 10 / Figs. 1, 2, 3, 7: group
ranges under each rotation, spectra, alignment, KL versus context, the error table), ``fragments``
(BitDecoding Fig. 3a: the mma.m16n8k16 register fragment layouts), ``bitdecoding`` (BitDecoding Fig. 5:
the induced low-bit packing of one lane; Fig. 6: the warp partition along N with sTMP and sAcc);
``common``: what they share (``new_figure`` / ``new_axes`` without pyplot, titles, outside legends, the
argument checks).
"""

from .aqua import plot_explained_variance, plot_higgs_grid, plot_residual_variance
from .bitdecoding import plot_induced_packing, plot_warp_partition
from .channels import plot_channel_magnitudes, plot_channel_sensitivity, plot_error_vs_boost
from .fragments import plot_fragment_layout
from .groups import group_ranges, plot_group_ranges
from .oscar import plot_alignment, plot_error_table, plot_kl_vs_context, plot_spectra, plot_token_groups
from .page_layout import plot_page_layout

__all__ = [
    "plot_channel_magnitudes",
    "plot_channel_sensitivity",
    "plot_error_vs_boost",
    "plot_page_layout",
    "plot_group_ranges",
    "group_ranges",
    "plot_explained_variance",
    "plot_higgs_grid",
    "plot_residual_variance",
    "plot_token_groups",
    "plot_spectra",
    "plot_alignment",
    "plot_kl_vs_context",
    "plot_error_table",
    "plot_fragment_layout",
    "plot_induced_packing",
    "plot_warp_partition",
]
