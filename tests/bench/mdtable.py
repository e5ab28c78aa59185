"""Markdown cells and tables of docs/performance.md (report.py and report_pypath.py)."""

from __future__ import annotations


def us(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}".replace(",", " ")
    if v >= 10:
        return f"{v:.0f}"
    return f"{v:.1f}"


def grp(v: float) -> str:
    return f"{v:,.0f}".replace(",", " ")


def ratio(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
