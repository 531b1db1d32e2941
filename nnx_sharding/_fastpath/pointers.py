"""`same_objects`: whether two lists hold the very same objects, compared in one step.

Why: on every fast call the `snapshot` proves that no container of the graphs gained,
lost or replaced a value: the identity of each of ~2,800 values for a depth-100 MLP. In
Python that is ``all(map(operator.is_, xs, ys))``, a function call per pair. A list's
``==`` is quicker, but it compares two different objects by their ``==``, and a Variable
or a scalar array compares equal to another one that holds the same value: a replaced
object would go unseen. A list keeps its items as an array of object pointers; two lists
hold the same objects in the same order exactly when those arrays are byte-equal.
`same_objects` copies both with ``ctypes.string_at`` and compares the bytes (a memcmp),
with no function call per value (measured: docs/performance.md, "Why the no-op step
stays above 2× floor (b)"). ``ctypes`` is part of the standard library; nothing is
compiled.

Sound because the snapshot keeps its objects alive (``ys``): an address is reused only
once its object is freed. The layout (``ob_item`` after the header of a variable-size
object, ``id`` the address) is probed once, at import (`_probe`); where it differs (another
Python implementation or build) or ``NNX_SHARDING_PUBLIC_SLOTS=1`` is set, `DIRECT` is
False and `same_objects` is ``all(map(operator.is_, ...))``: the same answers, slower.
"""

from __future__ import annotations

import ctypes
import os
import struct
from operator import is_
from typing import Any

_WORD = ctypes.sizeof(ctypes.c_void_p)
_ITEMS = 3 * ctypes.sizeof(ctypes.c_ssize_t)  # after ob_refcnt, ob_type and ob_size
_pointer_at = ctypes.c_size_t.from_address  # an address, as an int (c_void_p: None for 0)
_string_at = ctypes.string_at


def _pointers(xs: list[Any]) -> bytes:
    """The bytes of the item pointers of a non-empty list."""
    return _string_at(_pointer_at(id(xs) + _ITEMS).value, _WORD * len(xs))


def _same_pointers(xs: list[Any], ys: list[Any]) -> bool:
    n = len(xs)
    if n != len(ys):
        return False
    return n == 0 or _pointers(xs) == _pointers(ys)


def _same_by_is(xs: list[Any], ys: list[Any]) -> bool:
    return len(xs) == len(ys) and all(map(is_, xs, ys))


def _probe() -> bool:
    """Whether a list's item pointers read back as this module expects."""
    try:
        objects = [object() for _ in range(7)]
        copy = list(objects)
        other = [*objects[:3], object(), *objects[4:]]
        addresses = struct.pack(f"{len(objects)}P", *map(id, objects))
        return (
            _pointers(objects) == addresses
            and _pointers(copy) == addresses
            and _same_pointers(objects, copy)
            and not _same_pointers(objects, other)
            and not _same_pointers(objects, objects[:-1])
        )
    except Exception:  # noqa: BLE001 - any other layout: compare with operator.is_
        return False


DIRECT: bool = os.environ.get("NNX_SHARDING_PUBLIC_SLOTS") != "1" and _probe()
"""Whether list item pointers are compared directly (else one ``is`` per item)."""


def same_objects(xs: list[Any], ys: list[Any]) -> bool:
    """Whether the lists ``xs`` and ``ys`` hold the same objects (``is``) in the same order.

    Both must be plain ``list`` objects, and the caller must keep ``ys``'s objects alive.

    >>> a, b = object(), object()
    >>> same_objects([a, b], [a, b]), same_objects([a, b], [b, a])
    (True, False)
    """
    return (_same_pointers if DIRECT else _same_by_is)(xs, ys)
