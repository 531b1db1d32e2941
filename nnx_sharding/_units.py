"""Sizes and durations as people read them: ``1.50 KiB``, ``12.3 ms``."""

from __future__ import annotations

import math


def format_bytes(n: float) -> str:
    """Bytes in binary units, up to TiB.

    >>> format_bytes(1536), format_bytes(80 * 2**30), format_bytes(3)
    ('1.50 KiB', '80.00 GiB', '3 B')
    """
    if n < 1024:
        return f"{int(n)} B"
    exponent = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exponent:.2f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def format_seconds(s: float) -> str:
    """Seconds with three significant digits in s, ms, µs or ns.

    >>> format_seconds(0.0123), format_seconds(2.5)
    ('12.3 ms', '2.5 s')
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"
