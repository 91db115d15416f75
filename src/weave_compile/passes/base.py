"""The base class of the tokenweave passes and the digest of the code that decides a compiled graph.

Inductor's FX graph cache serves a graph compiled earlier when its key matches; the key includes
the pass manager's ``uuid()``. So that uuid must change whenever any code that decides what the
compiled graph contains changes: the passes, and everything they call (the op definitions and
their kernel selection, the smart split, the config, ...). :func:`library_digest` hashes every
module file of the ``weave_compile`` package except ``testing/`` (test helpers never run inside
a compile), found by walking the package directory: a new module is covered without a list to
keep up to date.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

#: Subpackages whose code never decides a compiled graph.
EXCLUDED = ("testing",)


def package_root() -> Path:
    import weave_compile

    return Path(weave_compile.__file__).resolve().parent


def library_files(root: Path) -> list[Path]:
    """Every ``.py`` file of the package at ``root`` except :data:`EXCLUDED` subpackages, sorted."""
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in EXCLUDED)


def library_digest(root: Path) -> str:
    """A digest of the path and text of every file of :func:`library_files`."""
    h = hashlib.sha256()
    for p in library_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """:func:`library_digest` of the installed package (read once per process)."""
    return library_digest(package_root())


class WeavePass:
    """A tokenweave pass: ``pass_(graph)`` rewrites the graph and returns what it did.

    ``uuid()`` hashes the pass's own source: its module, or every module of its package where the
    pass is a package's (``WHOLE_PACKAGE``: the token split, whose rewrite calls every module of
    its package).
    """

    #: the pass's source is every module of the package it is defined in
    WHOLE_PACKAGE = False

    def uuid(self) -> str:
        module = sys.modules[type(self).__module__]
        path = Path(module.__file__)
        whole = self.WHOLE_PACKAGE or path.name == "__init__.py"
        files = sorted(path.parent.rglob("*.py")) if whole else [path]
        h = hashlib.sha256()
        for p in files:
            h.update(p.read_bytes())
        return h.hexdigest()
