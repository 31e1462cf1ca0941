"""Plain-text tables for the trace scripts (right-aligned columns, a rule under the header)."""
from __future__ import annotations


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def ms(us: float) -> str:
    """Microseconds shown as milliseconds with three decimals."""
    return f"{us / 1e3:.3f}"


def pct(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"
