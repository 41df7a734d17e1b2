"""Even splits shared by the sharding types."""


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` (offset, size) ranges covering ``total``; sizes differ by at most one, none empty."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def least_loaded(loads: list[float], among: list[int] | None = None) -> int:
    ranks = among if among is not None else list(range(len(loads)))
    return min(ranks, key=lambda r: (loads[r], r))
