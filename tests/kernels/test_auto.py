"""Which implementation a fused site gets, and the reason the report shows (kernels/auto.py).

The symmetric-memory probe is stood in for (no GPU here): the tests set what it finds.
"""

import dataclasses

import pytest
import torch

from weave_compile import kernels
from weave_compile.kernels import auto, auto_table, registry
from weave_compile.kernels.shared import probe

CUDA = torch.device("cuda", 0)


def site(**kw) -> kernels.Site:
    """A bf16 site of H=4096 on 2 CUDA ranks (symbolic T unless given)."""
    base = dict(device=CUDA, dtype=torch.bfloat16, residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                hidden=4096, group_name="g", world_size=2)
    return kernels.Site(**{**base, **kw})


@pytest.fixture
def symm(monkeypatch):
    """The symmetric-memory probe and the hidden-size check, answering what the test sets; ``ce``
    (which also needs cuda-python) runs wherever they let it unless ``ce`` says why not."""
    from weave_compile.kernels.ce import copy_engine

    state = {"variant": "p2p", "reason": "p2p over symmetric memory", "hidden_problem": "", "ce": None}
    monkeypatch.setattr(probe, "probe", lambda group, device, dtype, hidden: probe.SymmProbe(
        state["variant"] is not None, state["variant"] == "multimem", state["reason"]))
    monkeypatch.setattr(probe, "check_hidden", lambda hidden, dtypes: state["hidden_problem"])
    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: state["ce"])
    return state


@pytest.fixture
def oneshot_ready():
    """The one-shot kernel as auto would see it once its measurement across GPUs is recorded."""
    old = registry.replace(dataclasses.replace(registry.get("oneshot"), auto_ready=True))
    yield
    registry.replace(old)


def test_reference_when_requested_or_off_gpu():
    assert auto.choose("reference", site()) == ("reference", "requested")
    kernel, why = auto.choose("auto", site(device=torch.device("cpu")))
    assert kernel == "reference" and "cpu tensors" in why


def test_auto_takes_the_available_variant(symm, request):
    # p2p capable, symbolic T: not one-shot; the measured table (world size 2) picks p2p.
    kernel, why = auto.choose("auto", site())
    assert kernel == "p2p" and why.startswith("auto: ") and "not oneshot: symbolic token count" in why
    # A small static T fits the one-shot kernel, but auto waits for its measurement across GPUs ...
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == "p2p" and "auto waits for its measurement across GPUs" in why
    # ... and takes it once that is recorded.
    request.getfixturevalue("oneshot_ready")
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == "oneshot" and why.startswith("auto: ") and "crossover" in why
    symm.update(variant="multimem", reason="multicast pointer present")
    assert auto.choose("auto", site()) == ("multimem", "auto: multicast pointer present")


def test_forced_kernels(symm):
    assert auto.choose("p2p", site()) == ("p2p", "requested")
    symm.update(variant="multimem")
    assert auto.choose("p2p", site()) == ("p2p", "requested (multimem also available)")
    symm.update(variant="p2p", reason="no multicast pointer")
    kernel, why = auto.choose("multimem", site())
    assert kernel == "reference" and why == "requested 'multimem' unavailable: no multicast pointer"


def test_a_hidden_size_or_dtype_the_kernels_cannot_take_falls_back_with_its_reason(symm):
    symm.update(hidden_problem="hidden size 4100 is not a multiple of 16 bytes")
    for requested in ("auto", "p2p"):
        kernel, why = auto.choose(requested, site(hidden=4100))
        assert kernel == "reference" and "not a multiple of 16 bytes" in why
    symm.update(variant=None, reason="no symmetric memory on this group", hidden_problem="")
    assert auto.choose("auto", site()) == ("reference", "no symmetric memory on this group")


def test_what_an_implementation_takes_decides_before_its_check(symm):
    """A scale or an eps on the device goes only where it is taken; nothing else is probed. Of
    auto's candidates only ce takes a scale: where it runs, a scaled site gets it by capability."""
    kernel, why = auto.choose("auto", site(has_scale=True))
    assert kernel == "ce" and "by capability" in why
    symm.update(ce="cuda-python is not installed (test)")
    kernel, why = auto.choose("auto", site(has_scale=True))
    assert kernel == "reference" and why == ("scaled site: only reference, ce, nccl take a scale; "
                                             "cuda-python is not installed (test)")
    kernel, why = auto.choose("p2p", site(has_scale=True))
    assert kernel == "reference" and why.startswith("requested 'p2p' unavailable: scaled site")
    kernel, why = auto.choose("auto", site(eps_on_device=True))
    assert kernel == "reference" and "eps is a device tensor" in why
    symm.update(variant=None, reason="probe must not decide this")
    assert "probe" not in auto.choose("auto", site(has_scale=True))[1]


def test_kernel_names():
    assert kernels.names() == ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")


# ----------------------------------------------------------------------------- ce and nccl (forced only)


BF16 = (torch.bfloat16,) * 3


def test_forced_on_cpu_falls_back_with_reason():
    for k in ("ce", "nccl"):
        kernel, why = auto.choose(k, site(device=torch.device("cpu")))
        assert kernel == "reference" and k in why and "cpu" in why


def test_forced_ce_without_cuda_python_says_so(monkeypatch):
    from weave_compile.kernels.ce import copy_engine
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: "cuda-python is not installed (test)")
    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    kernel, why = auto.choose("ce", site())
    assert kernel == "reference" and "cuda-python" in why


def test_hidden_too_large_is_refused(monkeypatch):
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(addnorm, "HAS_TRITON", True)
    kernel, why = auto.choose("nccl", site(hidden=1 << 15))
    assert kernel == "reference" and "hidden" in why


def test_a_forced_implementation_that_takes_a_scale_runs_a_scaled_site(monkeypatch):
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    assert auto.choose("nccl", site(has_scale=True)) == ("nccl", "requested")


# ----------------------------------------------------------------------------- the measured table


def test_auto_picks_only_measured_designs(symm):
    p2p, multimem = registry.get("p2p"), registry.get("multimem")
    # Measured: world 2, unsplit and split, p2p. Each pick names its source row.
    k, why = auto.from_table([p2p], site(num_tokens=2500))
    assert k == "p2p" and "nearest measured T=2048" in why and "2x H200" in why
    k, why = auto.from_table([p2p], site(num_tokens=5000, split=True))
    assert k == "p2p" and "split" in why
    # Multimem can run here but was never measured: the table does not pick it.
    k, _ = auto.from_table([multimem, p2p], site(num_tokens=4096))
    assert k == "p2p"
    k, why = auto.from_table([multimem], site(num_tokens=4096))
    assert k is None and "none of them can run here" in why
    # Unmeasured world size or size: the capability order's pick, and the reason says it is not measured.
    k, why = auto.choose("auto", site(world_size=8, num_tokens=4096))
    assert k == "p2p" and "world size 8" in why and "by capability" in why
    k, why = auto.choose("auto", site(num_tokens=40))
    assert k == "p2p" and "outside the measured range" in why and "by capability" in why
    # Nothing that can run: reference.
    symm.update(variant=None, reason="no symmetric memory")
    k, why = auto.choose("auto", site(num_tokens=4096))
    assert k == "reference" and "no symmetric memory" in why
    symm.update(variant="p2p", reason="ok")
    # Unknown T at compile time: the design that won at every measured T.
    k, why = auto.choose("auto", site())
    assert k == "p2p" and "unknown" in why


def test_table_rows_are_positive_times_of_selectable_kernels():
    assert auto_table.TABLE
    for (world, split), rows in auto_table.TABLE.items():
        assert world >= 2 and isinstance(split, bool)
        for t, row in rows.items():
            assert t > 0 and row and all(d in kernels.names() and us > 0 for d, us in row.items())
