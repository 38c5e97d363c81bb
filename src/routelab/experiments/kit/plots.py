"""The figure pieces the router sweeps' reports share: one bar per router with its error bar, and
saving a figure (lazily importing matplotlib with the ``Agg`` backend, so no display is needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["pyplot", "router_bars", "save_figure"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the ``Agg`` backend (files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def router_bars(ax: Any, routers: Sequence[str], means: Sequence[float], errors: Sequence[float], title: str, *,
                color: Any = "tab:blue", alpha: float = 0.8, rotation: float = 35) -> None:
    """One panel of ``ax``: a bar per router (``means``, error bars ``errors``), the routers as x labels."""
    ax.bar(range(len(routers)), list(means), yerr=list(errors), color=color, alpha=alpha, capsize=3)
    ax.set_xticks(range(len(routers)), list(routers), rotation=rotation, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def save_figure(fig: Any, out_dir: Path, name: str, drawn: list[str], *,
                rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out ``fig``, write it to ``out_dir / name`` (90 dpi), close it and add ``name`` to ``drawn``."""
    fig.tight_layout(**({"rect": rect} if rect is not None else {}))
    fig.savefig(Path(out_dir) / name, dpi=90)
    pyplot().close(fig)
    drawn.append(name)
