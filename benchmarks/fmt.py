"""How every benchmark report writes its numbers (one formatting for all the studies).

Each formatter takes ``None`` (or NaN) for "not measured" and writes ``-``.
"""

from __future__ import annotations

import math

__all__ = ["cores", "f", "k", "mb", "pct", "table", "x"]


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def k(v: float | None) -> str:
    """Steps/s compactly: 1234 -> ``1.23k``, 12345 -> ``12.3k``, 1.5e6 -> ``1.50M``."""
    if v is None or _missing(v):
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    if v >= 1e3:
        return f"{v / 1e3:.2f}k"
    return f"{v:.0f}"


def pct(v: float | None) -> str:
    """A fraction as a whole percentage: 0.934 -> ``93%``."""
    return "-" if v is None or _missing(v) else f"{100 * v:.0f}%"


def x(v: float | None) -> str:
    """A ratio: 1.234 -> ``1.23x``."""
    return "-" if v is None or _missing(v) else f"{v:.2f}x"


def mb(v: float | None) -> str:
    """Bytes as whole MiB."""
    return "-" if v is None or _missing(v) else f"{v / 2**20:.0f}"


def cores(v: float | None) -> str:
    """CPU cores with two decimals."""
    return "-" if v is None or _missing(v) else f"{v:.2f}"


def f(v: float | None, fmt: str = "{:.2f}") -> str:
    """Any number through ``fmt``."""
    return "-" if v is None or _missing(v) else fmt.format(v)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table (and a blank line after it)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
