"""The CRC-32 of checkpoint chunks: zlib's polynomial, computed with ISA-L's vectorised kernel
where the ``isal`` package is installed (carry-less multiply: several times zlib's speed), else
with zlib. Both give the same value, so files written with one are read with the other.

A full checkpoint of a model-sized state is gigabytes, and its crc was the writer's largest CPU
cost per byte: at zlib's speed, about one second per gigabyte of a core that training wants.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

try:  # the same function, faster
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - depends on the environment
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
BACKEND = "isal" if _isal_crc32 is not None else "zlib"
