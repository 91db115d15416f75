"""The measured choice's disk cache: found again under the same fingerprint, never under another."""

import json
import os

import pytest
import torch

from weave_compile.kernels.measured import cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def fp(**hardware):
    got = cache.fingerprint(torch.device("cpu"), (0, 1), "gloo", {"comm_ctas": 32}, ["reference", "as written"],
                            "d" * 24)
    got["hardware"].update(hardware)
    return got


def test_an_entry_is_found_under_its_fingerprint(cache_dir):
    answer = {"fused": True, "winners": {"k": {"8": "reference"}}}
    assert cache.load(fp()) == (None, "no cached entry")
    cache.save(fp(), answer)
    assert cache.load(fp()) == (answer, "")
    assert os.path.dirname(cache.entry_path(fp())) == os.path.join(str(cache_dir), "tokenweave_measured")


@pytest.mark.parametrize("change", [dict(name="NVIDIA H200"), dict(nccl="2.99.1"), dict(driver="other"),
                                    dict(env={"NCCL_ALGO": "Tree"}), dict(ranks=[0, 2]), dict(torch="9.9")])
def test_an_entry_from_other_hardware_or_versions_is_not_read(cache_dir, change):
    cache.save(fp(), {"fused": True})
    assert cache.load(fp(**change)) == (None, "no cached entry")


def test_an_entry_measured_on_other_code_is_not_read(cache_dir, monkeypatch):
    cache.save(fp(), {"fused": True})
    other = fp()
    other["designs"]["reference"] = "0" * 16  # its sources changed since
    assert cache.load(other)[0] is None
    monkeypatch.setattr(cache, "own_fingerprint", lambda: "f" * 16)
    assert cache.load(fp())[0] is None


def test_a_foreign_file_under_the_name_is_ignored(cache_dir):
    path = cache.entry_path(fp())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"fingerprint": fp(name="another GPU"), "answer": {"fused": True}}, f)
    assert cache.load(fp()) == (None, "cached entry made under another fingerprint: ignored")
    with open(path, "w") as f:
        f.write("{not json")
    assert cache.load(fp())[0] is None and "unreadable" in cache.load(fp())[1]


def test_the_fingerprint_covers_what_the_issue_lists():
    got = fp()
    assert {"hardware", "inductor", "options", "code", "designs", "digest"} <= set(got)
    assert {"ranks", "backend", "env", "torch", "triton"} <= set(got["hardware"])
    assert set(got["designs"]) == {"reference"}  # the site as written is plain torch: no source of ours


def test_machine_digest_is_stable_in_a_process():
    assert cache.machine_digest() == cache.machine_digest()
