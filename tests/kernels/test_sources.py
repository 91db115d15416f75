"""The fingerprint rule of kernels/sources.py: words do not change it, code does."""

from weave_compile.kernels import registry, sources


def test_fingerprints_ignore_words_but_not_code():
    code = 'def f(x):\n    """What f does."""\n    return x + 1  # why\n'
    assert sources.fingerprint({"a.py": code}) == sources.fingerprint(
        {"a.py": code.replace("What f does.", "Other words.").replace("# why", "")})
    assert sources.fingerprint({"a.py": code}) != sources.fingerprint({"a.py": code.replace("x + 1", "x + 2")})
    # The code's own text, so the GPU machine's Python fingerprints what this one does (ast.dump
    # differs between releases); docstrings with non-ASCII words and comments cut by column.
    wordy = 'def f(x):\n    """What f does \u2264 more.\n    Two lines."""\n    return x + 1  # why \u2014\n\n\nS = "# kept"\n'
    assert sources.normalized(wordy) == 'def f(x):\n    return x + 1\nS = "# kept"'


def test_every_builtin_design_has_its_sources_listed():
    assert set(sources.DESIGN_SOURCES) == set(registry.BUILTINS)
    fps = {d: sources.source_fingerprint(d) for d in registry.BUILTINS}
    assert all(len(fp) == 16 for fp in fps.values())
    assert len(set(fps.values())) == len(fps)  # every design's own files enter its fingerprint


def test_a_file_fingerprint_follows_its_code(tmp_path):
    p = tmp_path / "plugin.py"
    p.write_text("def run(x):\n    return x\n")
    before = sources.file_fingerprint(str(p))
    p.write_text("def run(x):\n    # a comment\n    return x\n")
    assert sources.file_fingerprint(str(p)) == before
    p.write_text("def run(x):\n    return -x\n")
    assert sources.file_fingerprint(str(p)) != before
