"""Contracts of the Kool et al. toy experiment's figures (routelab.experiments.kool_toy.figures).

These tests check the data handed to matplotlib (captured by wrapping the Axes drawing calls), the axes'
settings and which files are written, against hand-made records and hand-computed values, never pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from routelab.experiments.kool_toy import figures as F  # noqa: E402
from routelab.experiments.kool_toy.model import make_data  # noqa: E402

_DRAW = ("plot", "fill_between", "errorbar", "scatter", "axhline", "text", "legend", "axis")


class _Calls:
    """Every drawing call made on any Axes (``(axes, name, args, kwargs)``) and every saved figure."""

    def __init__(self) -> None:
        self.calls: list[tuple[Axes, str, tuple, dict]] = []
        self.saved: list[tuple[Figure, Path]] = []

    def of(self, name: str, ax: Axes | None = None) -> list[tuple[tuple, dict]]:
        return [(a, k) for (x, n, a, k) in self.calls if n == name and (ax is None or x is ax)]

    @property
    def fig(self) -> Figure:
        assert len(self.saved) == 1, self.saved
        return self.saved[0][0]


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    calls = _Calls()
    for name in _DRAW:
        orig = getattr(Axes, name)

        def wrapper(self, *args, _orig=orig, _name=name, **kwargs):
            calls.calls.append((self, _name, args, kwargs))
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(Axes, name, wrapper)
    orig_save = Figure.savefig

    def savefig(self, path, *args, **kwargs):
        calls.saved.append((self, Path(path)))
        return orig_save(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return calls


def _r(config: str, method: str, tau: float, mse: float, **extra) -> dict:
    return {"config": config, "method": method, "tau": tau, "mse": mse, **extra}


def _close(a, b) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- MSE-vs-tau panels


def test_panel_plots_median_and_quartiles_of_its_config_sorted_by_tau(rec: _Calls, tmp_path: Path) -> None:
    """Fig. 2(b)/(c): per method (in METHODS order), the line is the nan-median MSE over seeds at each tau
    (taus ascending, whatever the record order), the band is the 25th-75th percentile, only records of the
    panel's config count, and the success threshold 0.02 is drawn; axes are log-log with the fixed MSE range.
    """
    records = [
        _r("reinforce", "gumbel_matching", 0.5, 0.01),
        _r("reinforce", "sample", 1.0, 0.05),
        _r("reinforce", "sample", 1.0, float("nan")),
        _r("reinforce", "sample", 1.0, 0.07),
        _r("reinforce", "sample", 0.1, 0.3),
        _r("reinforce", "sample", 0.1, 0.1),
        _r("reinforce", "sample", 0.1, 1.0),
        _r("reinforce", "sample", 0.1, 0.2),
        _r("gating", "sample", 0.1, 2.0),  # another config: must not enter
        _r("gating", "sample_skip", 0.1, 2.0),
    ]
    path = tmp_path / "panel.png"
    F.plot_config(path, records, "reinforce", "my title")
    assert path.stat().st_size > 0 and rec.saved[0][1] == path
    (ax,) = rec.fig.axes
    plots = rec.of("plot", ax)
    assert [k["label"] for _, k in plots] == ["Sample", "Gumbel-Matching"]
    (x, y), k = plots[0]
    _close(x, [0.1, 1.0])
    _close(y, [0.25, 0.06])  # median of {0.1, 0.2, 0.3, 1.0}; nan-median of {0.05, nan, 0.07}
    assert (k["color"], k["ls"], k["marker"]) == ("tab:blue", "-", "o")
    (x, y), k = plots[1]
    _close(x, [0.5])
    _close(y, [0.01])
    assert (k["color"], k["ls"], k["marker"]) == ("tab:red", "--", "v")
    fills = rec.of("fill_between", ax)
    assert len(fills) == 2
    (x, lo, hi), k = fills[0]
    _close(x, [0.1, 1.0])
    _close(lo, [0.175, 0.055])  # numpy's linear percentiles, by hand
    _close(hi, [0.475, 0.065])
    assert k["color"] == "tab:blue"
    ((thr,), _), = rec.of("axhline", ax)
    assert thr == pytest.approx(0.02)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_ylim() == pytest.approx(F.YLIM)
    assert ax.get_title() == "my title"
    assert ax.get_legend() is not None
    assert not rec.of("text", ax)


def test_panel_without_runs_of_its_config_says_not_run(rec: _Calls, tmp_path: Path) -> None:
    """A panel whose config has no records draws no series and no legend, but writes "not run"."""
    F.plot_config(tmp_path / "p.png", [_r("gating", "sample", 0.1, 0.5)], "reinforce", "t")
    (ax,) = rec.fig.axes
    assert not rec.of("plot", ax) and not rec.of("fill_between", ax)
    assert [a[2] for a, _ in rec.of("text", ax)] == ["not run"]
    assert ax.get_legend() is None


def test_grid_legend_only_in_first_panel_and_missing_cells_blank(rec: _Calls, tmp_path: Path) -> None:
    """plot_grid: a ragged grid draws one panel per given cell with the legend only in the top-left one,
    and turns the axes of cells beyond a row's end off."""
    records = [_r(c, "sample", 0.1, 0.1) for c in ("a", "b", "c")]
    F.plot_grid(tmp_path / "g.png", records, [[("a", "A"), ("b", "B")], [("c", "C")]], "sup")
    axes = rec.fig.axes
    assert len(axes) == 4
    assert [ax.get_title() for ax in axes] == ["A", "B", "C", ""]
    assert [ax.get_legend() is not None for ax in axes] == [True, False, False, False]
    assert [len(rec.of("plot", ax)) for ax in axes] == [1, 1, 1, 0]
    assert [ax.axison for ax in axes] == [True, True, True, False]
    assert rec.fig.get_suptitle() == "sup"


# ----------------------------------------------------------------------------- other figures


def test_importance_weights_median_of_iw_max_of_reinforce_by_default(rec: _Calls, tmp_path: Path) -> None:
    """The importance-weight figure plots, per method and tau, the median over seeds of ``iw_max`` (not
    ``iw_mean``, not the max) of the ``reinforce`` config unless told otherwise."""
    records = [
        _r("reinforce", "sample_skip_iw", 1.0, 0.1, iw_max=10.0, iw_mean=1.0),
        _r("reinforce", "sample_skip_iw", 1.0, 0.1, iw_max=1.0, iw_mean=1.0),
        _r("reinforce", "sample_skip_iw", 1.0, 0.1, iw_max=2.0, iw_mean=1.0),
        _r("reinforce", "sample_skip_iw", 0.1, 0.1, iw_max=5.0, iw_mean=1.5),
        _r("gating", "sample_skip_iw", 0.1, 0.1, iw_max=99.0, iw_mean=9.0),
        _r("gating", "gumbel_matching_iw", 0.1, 0.1, iw_max=99.0, iw_mean=9.0),
    ]
    F.plot_importance_weights(tmp_path / "iw.png", records)
    (ax,) = rec.fig.axes
    ((x, y), k), = rec.of("plot", ax)
    _close(x, [0.1, 1.0])
    _close(y, [5.0, 2.0])
    assert k["label"] == "Sample Skip IW" and k["color"] == "tab:green"
    assert "reinforce" in ax.get_title()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


def test_curves_fraction_of_runs_strictly_below_threshold(rec: _Calls, tmp_path: Path) -> None:
    """Training curves: at each step, the fraction of the method's runs (all taus pooled, runs without a
    curve skipped) whose MSE is strictly below 0.02; one panel per config, titled, legend in one panel."""
    records = [
        _r("reinforce", "sample", 0.1, 0.0, mse_curve=[(0, 0.5), (10, 0.02), (20, 0.01)]),
        _r("reinforce", "sample", 1.0, 0.0, mse_curve=[(0, 0.5), (10, 0.01), (20, 0.03)]),
        _r("reinforce", "sample", 1.0, 0.0, mse_curve=None),
        _r("gating", "sample", 1.0, 0.0, mse_curve=[(0, 0.001), (10, 0.001), (20, 0.001)]),
    ]
    F.plot_curves(tmp_path / "c.png", records, [("reinforce", "R"), ("none", "N")])
    ax0, ax1 = rec.fig.axes
    ((steps, frac), k), = rec.of("plot", ax0)
    _close(steps, [0, 10, 20])
    _close(frac, [0.0, 0.5, 0.5])  # 0.02 itself is not a success
    assert k["label"] == "Sample"
    assert not rec.of("plot", ax1)
    assert [ax.get_title() for ax in (ax0, ax1)] == ["R (all τ)", "N (all τ)"]
    assert ax0.get_legend() is not None and ax1.get_legend() is None


def test_curves_of_different_lengths_pool_where_they_meet(rec: _Calls, tmp_path: Path) -> None:
    """Runs of different lengths or evaluation intervals (a resumed sweep with more steps, another
    eval_every): the fraction at each step is over the runs that recorded it (it raised IndexError, or
    read the first run's steps off every other run's positions)."""
    records = [
        _r("reinforce", "sample", 0.1, 0.0, mse_curve=[(0, 0.5), (20, 0.01)]),
        _r("reinforce", "sample", 1.0, 0.0, mse_curve=[(0, 0.01), (10, 0.01), (20, 0.03), (30, 0.001)]),
    ]
    F.plot_curves(tmp_path / "c.png", records, [("reinforce", "R")])
    ((steps, frac), _), = rec.of("plot", rec.fig.axes[0])
    _close(steps, [0, 10, 20, 30])
    _close(frac, [0.5, 1.0, 0.5, 1.0])


def test_marginals_error_bars(rec: _Calls, tmp_path: Path) -> None:
    """Marginals figure: max |diff| with its own standard error; mean |diff| with error bar
    ``mean_se / sqrt(n * matrices)``; the unbalanced mean and the noise floor as plain lines, against n."""
    marg = [
        {"n": 4, "matrices": 9, "max_abs_diff": 0.2, "se_of_max": 0.01, "mean_abs_diff": 0.1, "mean_se": 0.6,
         "mean_abs_diff_unbalanced": 0.3, "noise_floor": 0.05},
        {"n": 16, "matrices": 4, "max_abs_diff": 0.1, "se_of_max": 0.02, "mean_abs_diff": 0.05, "mean_se": 0.8,
         "mean_abs_diff_unbalanced": 0.2, "noise_floor": 0.02},
    ]
    F.plot_marginals(tmp_path / "m.png", marg)
    (ax,) = rec.fig.axes
    (mx, mk), (mn, nk) = rec.of("errorbar", ax)
    _close(mx[0], [4, 16])
    _close(mx[1], [0.2, 0.1])
    _close(mk["yerr"], [0.01, 0.02])
    _close(mn[1], [0.1, 0.05])
    _close(nk["yerr"], [0.6 / 6.0, 0.8 / 8.0])
    (un, _), (floor, _) = rec.of("plot", ax)
    _close(un[1], [0.3, 0.2])
    _close(floor[1], [0.05, 0.02])
    assert ax.get_xscale() == "log"


def test_data_figure_true_function_not_drawn_across_jump(rec: _Calls, tmp_path: Path) -> None:
    """Fig. 2(a): the scatter is seed 0's data; the true function is drawn as two pieces, the left one
    strictly left of the jump at x = 0.5 (on 0.8x - 0.2), the right one from 0.5 on (on -2x + 2)."""
    F.plot_data(tmp_path / "d.png")
    (ax,) = rec.fig.axes
    ((sx, sy), _), = rec.of("scatter", ax)
    x, y = make_data(0)
    _close(sx, x.numpy())
    _close(sy, y.numpy())
    ((lx, ly), _), ((rx, ry), _) = rec.of("plot", ax)
    assert lx.min() == pytest.approx(-1.0) and lx.max() < 0.5
    np.testing.assert_allclose(ly, 0.8 * lx - 0.2, atol=1e-6)
    assert rx.min() == pytest.approx(0.5) and rx.max() == pytest.approx(1.0)
    np.testing.assert_allclose(ry, -2.0 * rx + 2.0, atol=1e-6)


def test_draw_figures_writes_only_the_figures_it_has_data_for(rec: _Calls, tmp_path: Path) -> None:
    """draw_figures writes every file of FIGURES except the marginals one when no marginals are given
    (None or empty) and the training-curves one when no record has a curve."""
    records = [_r(c, "sample", 0.1, 0.1, iw_max=1.5) for c in ("reinforce", "gating")]
    for marginals in (None, []):
        out = tmp_path / repr(marginals)
        out.mkdir()
        F.draw_figures(out, records, marginals)
        expected = {v for k, v in F.FIGURES.items() if k not in ("marginals", "curves")}
        assert {p.name for p in out.iterdir()} == expected
    assert len(rec.saved) == 2 * len(expected)
