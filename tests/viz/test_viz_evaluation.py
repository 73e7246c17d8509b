"""kvq.viz.evaluation.plot_quality_vs_bits: one series per method, hollow paper configurations, budget
lines, a readable figure (title, labelled axes, legend outside the data), clear errors."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from kvq.viz.evaluation import plot_quality_vs_bits  # noqa: E402

POINTS = [{"method": "KIVI-K2V2", "bits": 2.30, "value": 13.0, "config": "paper"},
          {"method": "KIVI-K2V2", "bits": 2.48, "value": 12.6, "config": "<=2.5"},
          {"method": "KIVI-K2V2", "bits": 4.44, "value": 12.1, "config": "<=4.5"},
          {"method": "OSCAR", "bits": 2.49, "value": 12.2, "config": "<=2.5"}]


def test_series_markers_budgets_and_labels():
    fig = plot_quality_vs_bits(POINTS, quality="perplexity", budgets=[2.5, 4.5], reference=("FP16", 11.9))
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_title() == "perplexity against bits per element"
    assert ax.get_xlabel().startswith("bits per element") and ax.get_ylabel() == "perplexity"
    lines = ax.get_lines()
    kivi = [ln for ln in lines if ln.get_marker() == "o" and len(ln.get_xdata()) == 1]
    assert sorted(float(ln.get_xdata()[0]) for ln in kivi) == [2.30, 2.48, 4.44]
    hollow = [ln for ln in kivi if ln.get_markerfacecolor() == "none"]
    assert [float(ln.get_xdata()[0]) for ln in hollow] == [2.30]                 # the paper configuration
    curve = next(ln for ln in lines if len(ln.get_xdata()) == 3)
    assert list(curve.get_xdata()) == [2.30, 2.48, 4.44]                         # joined in order of bits
    vlines = [ln for ln in lines if list(ln.get_xdata()) in ([2.5, 2.5], [4.5, 4.5])]
    assert len(vlines) == 2
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["KIVI-K2V2", "OSCAR"] and "FP16" in labels
    leg = ax.get_legend().get_window_extent()
    assert leg.x0 >= ax.get_window_extent().x1 - 1                              # outside the data area


def test_bad_points():
    with pytest.raises(ValueError, match="points is empty"):
        plot_quality_vs_bits([])
    with pytest.raises(ValueError, match=r"points\[0\] must be a dict"):
        plot_quality_vs_bits([{"method": "a", "bits": 2.0}])
    with pytest.raises(ValueError, match=r"points\[0\]\['bits'\]"):
        plot_quality_vs_bits([{"method": "a", "bits": 0, "value": 1.0}])
    with pytest.raises(ValueError, match=r"points\[0\]\['value'\]"):
        plot_quality_vs_bits([{"method": "a", "bits": 2.0, "value": float("nan")}])
    with pytest.raises(ValueError, match="log y axis"):
        plot_quality_vs_bits([{"method": "a", "bits": 2.0, "value": 0.0}], log_y=True)
    with pytest.raises(ValueError, match="budgets"):
        plot_quality_vs_bits([{"method": "a", "bits": 2.0, "value": 1.0}], budgets=[-1])
