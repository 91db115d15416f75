"""The pass manager's uuid (part of Inductor's FX-graph-cache key) changes with every library module."""

import hashlib
import importlib.util
import shutil
import sys

import pytest

from weave_compile.config import TokenWeaveConfig
from weave_compile.passes import base
from weave_compile.passes.pass_manager import WeavePassManager


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of the package the digest reads instead of the real one."""
    root = tmp_path / "weave_compile"
    shutil.copytree(base.package_root(), root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(base, "package_root", lambda: root)
    base.sources_digest.cache_clear()
    yield root
    base.sources_digest.cache_clear()


def _uuid() -> str:
    base.sources_digest.cache_clear()
    return WeavePassManager(TokenWeaveConfig()).uuid()


def test_editing_any_library_module_changes_the_manager_uuid(package_copy):
    files = base.library_files(package_copy)
    names = {p.relative_to(package_copy).as_posix() for p in files}
    # The modules that decide the graph, among them the ones a hand-written list once missed.
    assert {"config.py", "passes/split_tokens/smart_split.py", "ops/allreduce_rmsnorm.py", "kernels/auto.py", "kernels/registry.py",
            "passes/split_tokens/rules.py"} <= names
    assert any(n.startswith("kernels/") and n != "kernels/__init__.py" for n in names), names
    assert not any(n.startswith("testing/") for n in names)
    before = _uuid()
    seen = {before}
    for p in files:
        original = p.read_bytes()
        p.write_bytes(original + b"\n# an edit\n")
        changed = _uuid()
        assert changed not in seen, f"editing {p.relative_to(package_copy)} left the uuid unchanged"
        seen.add(changed)
        p.write_bytes(original)
    assert _uuid() == before


def test_a_new_module_changes_the_uuid_and_testing_does_not(package_copy):
    before = _uuid()
    helper = next((package_copy / "testing").glob("*.py"))
    helper.write_bytes(helper.read_bytes() + b"\n# test helpers never run inside a compile\n")
    assert _uuid() == before
    (package_copy / "passes" / "new_pass.py").write_text("X = 1\n")
    assert _uuid() != before


def test_every_imported_library_module_is_in_the_digest():
    import weave_compile.backend  # noqa: F401  (imports everything a compile uses)

    files = set(base.library_files(base.package_root()))
    for name, mod in list(sys.modules.items()):
        if name.startswith("weave_compile") and not name.startswith("weave_compile.testing"):
            path = getattr(mod, "__file__", None)
            if path:
                assert base.Path(path).resolve() in files, name


def test_a_pass_uuid_hashes_its_own_source(tmp_path):
    src = tmp_path / "a_weave_pass.py"
    src.write_text("from weave_compile.passes.base import WeavePass\n\nclass P(WeavePass):\n    pass\n")
    spec = importlib.util.spec_from_file_location("a_weave_pass", src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["a_weave_pass"] = mod
    try:
        spec.loader.exec_module(mod)
        first = mod.P().uuid()
        assert first == hashlib.sha256(src.read_bytes()).hexdigest()
        src.write_text(src.read_text() + "# changed\n")
        assert mod.P().uuid() != first
    finally:
        del sys.modules["a_weave_pass"]


def test_the_split_pass_uuid_covers_its_whole_package():
    from weave_compile.passes.split_tokens.split import SplitTokensPass

    pkg = base.package_root() / "passes" / "split_tokens"
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*.py")):
        h.update(p.read_bytes())
    assert SplitTokensPass(TokenWeaveConfig()).uuid() == h.hexdigest()
