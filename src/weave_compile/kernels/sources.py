"""Which source files each implementation's measured time depends on, and their fingerprint.

A measurement of a design (a row of ``auto_table``, an entry of the measured choice's cache) holds
only while the code it timed is unchanged. :data:`DESIGN_SOURCES` lists, per built-in design, the
files under ``src/weave_compile`` its time depends on; :func:`fingerprint` hashes them with
docstrings, comments and blank lines left out, so an edit of words keeps the measurement and an
edit of code drops it. ``benchmarks/make_auto_table.py`` applies the same rule to the rows it
reads (it loads this file by path, importing no torch); :mod:`.measured.cache` keys its entries
by it.

Standard library only: importable without torch.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import tokenize
from typing import Callable

#: Every implementation gets its arguments and row helpers from these. The op's dispatch
#: (``ops/allreduce_rmsnorm.py``) is not a design's code: host-side work that the CUDA-graph
#: replays every timing uses does not repeat.
_OP = ["kernels/spec.py", "rows.py"]
#: The symmetric-memory designs' shared parts.
_SYMM = ["kernels/shared/common.py", "kernels/shared/shapes.py", "kernels/shared/rownorm.py",
         "kernels/shared/sync.py", "kernels/shared/workspace.py", "kernels/shared/symm_call.py",
         "kernels/shared/probe.py", "kernels/shared/outside_pool.py"]
_ADDNORM = ["kernels/shared/addnorm.py", "kernels/shared/rownorm.py", "kernels/shared/common.py",
            "kernels/shared/shapes.py"]
#: Files (or folders, ending in ``/``) under ``src/weave_compile`` whose code a design's
#: measurement depends on.
DESIGN_SOURCES = {
    "reference": _OP + ["kernels/reference.py"],
    "nccl": _OP + ["kernels/nccl.py"] + _ADDNORM,
    "p2p": _OP + ["kernels/p2p/"] + _SYMM,
    "multimem": _OP + ["kernels/multimem/"] + _SYMM,
    "oneshot": _OP + ["kernels/oneshot/"] + _SYMM,
    "ce": _OP + ["kernels/ce/"] + _ADDNORM + _SYMM,
}

#: The ``weave_compile`` package folder this file lives in.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _char_col(line: str, byte_col: int) -> int:
    """ast's column (UTF-8 bytes) as a character index into ``line``."""
    return len(line.encode()[:byte_col].decode(errors="ignore"))


def normalized(text: str) -> str:
    """The module's code without docstrings, comments and blank lines (an edit of words leaves it
    unchanged). Built from the source text itself, not from ``ast.dump``, whose output differs
    between Python releases: a design measured under the GPU machine's Python must fingerprint
    the same here."""
    lines = text.splitlines()
    spans = []  # ((line, char col), (line, char col)) to cut, 1-based lines
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            e = body[0]
            spans.append(((e.lineno, _char_col(lines[e.lineno - 1], e.col_offset)),
                          (e.end_lineno, _char_col(lines[e.end_lineno - 1], e.end_col_offset))))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            spans.append((tok.start, tok.end))
    for (l0, c0), (l1, c1) in sorted(spans, reverse=True):
        if l0 == l1:
            lines[l0 - 1] = lines[l0 - 1][:c0] + lines[l0 - 1][c1:]
        else:
            lines[l0 - 1:l1] = [lines[l0 - 1][:c0] + lines[l1 - 1][c1:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def fingerprint(texts: dict[str, str]) -> str:
    """One hash over ``{relative path: source}``, docstrings and comments left out."""
    h = hashlib.sha256()
    for rel in sorted(texts):
        h.update(rel.encode() + b"\0" + normalized(texts[rel]).encode() + b"\0")
    return h.hexdigest()[:16]


def expand(listing: Callable[[str], list[str]], design: str) -> list[str]:
    """``design``'s source files, folders listed by ``listing(folder)`` (paths relative to the package)."""
    out = []
    for entry in DESIGN_SOURCES[design]:
        out += sorted(p for p in listing(entry) if p.endswith(".py")) if entry.endswith("/") else [entry]
    return sorted(set(out))


def source_fingerprint(design: str, root: str = PACKAGE_ROOT) -> str:
    """The fingerprint of ``design``'s sources under ``root`` (a ``weave_compile`` package folder)."""
    def listing(folder):
        base = os.path.join(root, folder)
        return [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                for d, _, files in os.walk(base) for f in files]

    texts = {}
    for rel in expand(listing, design):
        with open(os.path.join(root, rel)) as f:
            texts[rel] = f.read()
    return fingerprint(texts)


def file_fingerprint(path: str) -> str:
    """The fingerprint of one file (a design outside :data:`DESIGN_SOURCES`: a plugin's, a test's)."""
    with open(path) as f:
        return fingerprint({os.path.basename(path): f.read()})
