"""Inductor's output code of the compiles inside a block, and whether two compiles generated the same.

A site the backend leaves as written must cost nothing: the graph around it should compile to the
very code plain Inductor generates. :func:`captured` collects the output code (wrapper and kernels)
of every compile in its block, cache hits included (Inductor hands a cached graph's code to the
same hook); :func:`compare` says whether two such lists are the same program. Two programs with the
same code launch the same kernels in the same order with the same launch parameters, so a time
difference between them is the measurement's (or the memory placement's), not the backend's.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Iterator

#: Comment lines that name where a kernel's file is cached or which FX nodes it came from: they can
#: differ between two compiles of one program (node names are the graph's, not the code's).
_VOLATILE = re.compile(r"^\s*# (kernel path|AOT ID|Source Nodes|Original ATen|Topologically Sorted Source Nodes|"
                       r"Graph fragment|Unsorted Source Nodes)\b")
_COMMENT = re.compile(r"^\s*#")


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """The output code of each Inductor compile inside the block (a list, filled as they happen),
    except the sites as written that the measured choice compiles to time them: not the user's
    program.

    Unlike ``torch._inductor.utils.run_and_get_code`` it leaves Dynamo's caches alone, so it can
    wrap the first call of one compiled callable among several live ones."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    from weave_compile.kernels.measured.timing import in_measurement

    codes: list[str] = []

    def save(code: str) -> None:
        if not in_measurement():
            codes.append(code)

    with mock.patch.object(GraphLowering, "save_output_code", save):
        yield codes


def normalized(codes: list[str], comments: bool = True) -> list[str]:
    """``codes`` as lines, without the volatile comment lines (``comments=False``: without any)."""
    drop = _VOLATILE if comments else _COMMENT
    return [line.rstrip() for code in codes for line in code.splitlines() if not drop.match(line)]


def compare(base: list[str], other: list[str]) -> str:
    """``"same"``: the same program (volatile comments aside); ``"same but comments"``; or
    ``"differs: N lines"`` (lines added or removed, comments ignored); ``""`` when either compiled
    nothing inside its block (nothing to compare)."""
    if not base or not other:
        return ""
    if normalized(base) == normalized(other):
        return "same"
    a, b = normalized(base, comments=False), normalized(other, comments=False)
    if a == b:
        return "same but comments"
    changed = sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
                  if line[:1] in "+-" and not line.startswith(("+++", "---")))
    return f"differs: {changed} lines"


def diff(base: list[str], other: list[str], names: tuple[str, str] = ("base", "other")) -> str:
    """A unified diff of the two programs (volatile comments left out), for a reader."""
    return "\n".join(difflib.unified_diff(normalized(base), normalized(other), *names, lineterm=""))
