"""The op's ``kernel`` argument as a table by token count: one design per bucket of calls.

A site whose token count is symbolic is timed at several buckets (:mod:`.signature`), and the
fastest design may differ between them. The choice then travels in the op's ``kernel``
argument as a table, ``"by_tokens:nccl<=64,p2p<=2048,ce"``: the first design whose bound holds
the call's token count runs it, the last (unbounded) one every larger call. Being an argument,
the table enters the graph's communication plan (the ranks' first-call agreement compares it)
and every cache key, as a plain name does.
"""

from __future__ import annotations

from typing import Optional

PREFIX = "by_tokens:"


def encode(entries: list[tuple[int, str]]) -> str:
    """``[(highest token count, design), ...]`` (any order) as a ``kernel`` argument: a plain name
    where one design covers every bucket; consecutive buckets of one design are merged."""
    merged: list[tuple[int, str]] = []
    for top, design in sorted(entries):
        if merged and merged[-1][1] == design:
            merged[-1] = (top, design)
        else:
            merged.append((top, design))
    if not merged:
        raise ValueError("a kernel table needs at least one design")
    if len(merged) == 1:
        return merged[0][1]
    return PREFIX + ",".join([f"{d}<={t}" for t, d in merged[:-1]] + [merged[-1][1]])


def decode(kernel: str) -> Optional[list[tuple[Optional[int], str]]]:
    """``[(highest token count or None for the rest, design), ...]`` of a table, None for a plain name.
    ValueError for a malformed table."""
    if not kernel.startswith(PREFIX):
        return None
    out: list[tuple[Optional[int], str]] = []
    parts = kernel[len(PREFIX):].split(",")
    for i, part in enumerate(parts):
        design, sep, top = part.partition("<=")
        if not design or (sep and not top.isdigit()) or (not sep and i != len(parts) - 1) or (sep and i == len(parts) - 1):
            raise ValueError(f"malformed kernel table {kernel!r} (expected {PREFIX}a<=N,...,b)")
        out.append((int(top) if sep else None, design))
    tops = [t for t, _ in out[:-1]]
    if tops != sorted(set(tops)):
        raise ValueError(f"malformed kernel table {kernel!r}: bounds must increase")
    return out


def designs(kernel: str) -> list[str]:
    """Every design a ``kernel`` argument can run."""
    table = decode(kernel)
    return [kernel] if table is None else [d for _, d in table]


def resolve(kernel: str, num_tokens: int) -> str:
    """The design that runs a call of ``num_tokens`` tokens."""
    table = decode(kernel)
    if table is None:
        return kernel
    for top, design in table:
        if top is None or num_tokens <= top:
            return design
    raise AssertionError("unreachable: a decoded table ends with an unbounded design")


def describe(kernel: str) -> str:
    """``"nccl to T=64, p2p to T=2048, ce above"`` for a table, the name itself otherwise."""
    table = decode(kernel)
    if table is None:
        return kernel
    return ", ".join(f"{d} to T={t}" if t is not None else f"{d} above" for t, d in table)
