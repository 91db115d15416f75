"""Module backward hooks under no_grad / inference_mode: traced as no-ops for tokenweave, untouched elsewhere."""

import pytest
import torch
from torch._dynamo.exc import Unsupported

from weave_compile import backward_hooks
from weave_compile.backend import tokenweave_backend

OPTIONS = {"compiler": "aot_eager"}  # (no process group: the backend compiles the graph as is)


class Block(torch.nn.Module):
    """A norm with a full backward hook (as transformers 5.17 puts on Qwen3's q/k norms) or a
    full backward pre-hook, between two linears."""

    def __init__(self, pre: bool = False):
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.RMSNorm(16)
        self.calls = 0
        if pre:
            self.norm.register_full_backward_pre_hook(self._count_pre)
        else:
            self.norm.register_full_backward_hook(self._count)

    def _count(self, module, grad_input, grad_output):
        self.calls += 1

    def _count_pre(self, module, grad_output):
        self.calls += 1

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def _compiled(model, backend="tokenweave"):
    torch._dynamo.reset()
    kwargs = {"options": OPTIONS} if backend == "tokenweave" else {}
    return torch.compile(model, backend=backend, fullgraph=True, **kwargs)


@pytest.mark.parametrize("pre", [False, True], ids=["hook", "pre_hook"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_grad_disabled_compiles_whole_with_the_hook_kept(mode, pre):
    torch.manual_seed(0)
    model, x = Block(pre), torch.randn(5, 8)
    with mode():
        out = _compiled(model)(x)
        expected = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # The hook is still the model's and fires in a backward outside the compiled graph.
    model(x.requires_grad_()).sum().backward()
    assert model.calls == 1


def test_grad_enabled_keeps_dynamos_own_error():
    """With grad enabled the hook can fire: Dynamo's handling (compiled autograd) is not ours to replace."""
    with pytest.raises(Unsupported, match="backwards hooks require compiled autograd"):
        _compiled(Block())(torch.randn(5, 8))


def test_another_backend_keeps_dynamos_own_error():
    """Only frames compiled for tokenweave are traced differently (what the patch would break for
    others is theirs to decide)."""
    with torch.no_grad(), pytest.raises(Unsupported, match="backwards hooks require compiled autograd"):
        _compiled(Block(), backend="aot_eager")(torch.randn(5, 8))


def test_install_is_done_on_import_and_idempotent():
    assert backward_hooks.install(tokenweave_backend) is True
    assert backward_hooks.install(tokenweave_backend) is True
