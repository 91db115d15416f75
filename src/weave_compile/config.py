"""Typed options of the ``tokenweave`` backend.

``torch.compile(model, backend="tokenweave", options={...})`` hands the dict to
:meth:`TokenWeaveConfig.from_options`, which rejects unknown keys with an error that lists
every valid key (a misspelt option must never be silently ignored), and a wrong type or an
out-of-range value with an error that names the option, what it accepts and what was given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal, get_args, get_type_hints

Compiler = Literal["inductor", "aot_eager"]
SplitCost = Literal["measured", "formula"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclasses.dataclass(frozen=True)
class TokenWeaveConfig:
    """Options of the ``tokenweave`` backend. Every field is documented in README.md."""

    #: Rewrite ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` into one fused op.
    fuse: bool = True
    #: Keep the residual stream sharded by token rows between fused sites whose only
    #: consumer of the residual is the next fused site.
    shard_residual: bool = True
    #: Implementation of the fused op: ``auto`` (the policy of ``kernels/auto.py``: a preferred
    #: design where it can run, else the fastest design measured for the world size, token count
    #: and split, else by capability) or the name of a registered implementation
    #: (``weave_compile.kernels.names()``), which forces it. A forced implementation that cannot
    #: run falls back to the fallback implementation with the reason in ``explain()``.
    kernel: str = "auto"
    #: Let the ``p2p`` kernel leave its normed output in the symmetric output ring where the
    #: peers pushed it (no copy of their rows), wherever the ``output`` pass proves every reader
    #: runs before the ring slot is written again; elsewhere it is copied out as before, with the
    #: reason in ``explain()``. Off by default until its GPU tests have run (docs/performance.md).
    output_in_place: bool = False
    #: Thread blocks the fused communication kernel may occupy (1-32). 32 measured fastest on
    #: 2x H200 at every T >= 512 without overlap (docs/performance.md); TokenWeave uses 2-8
    #: while overlapping.
    comm_ctas: int = 32
    #: Split each layer into a token prefix and suffix whose fused communication runs on a
    #: second, high-priority stream while the other half computes (TokenWeave's overlap).
    #: Off by default: on 2x H200 (p2p kernel, 32 SMs) it measured 3-14% slower than the fused
    #: op alone at every token count (docs/performance.md).
    split: bool = False
    #: Fewest tokens (batch x sequence) for which the split is used; below it the fused op runs
    #: unsplit. TokenWeave's value for dense models.
    split_threshold: int = 1024
    #: Prefix length to use instead of the computed smart split (0: computed). For sweeps.
    split_at: int = 0
    #: SM count the SM formula plans GEMM waves for (0: the device's; 132 off-GPU).
    num_sms: int = 0
    #: What the smart split's GEMM times come from: ``measured`` (cuBLAS timed at compile time on
    #: the GPU, cached on disk; the SM formula off-GPU) or ``formula`` (the SM-count formula).
    split_cost: SplitCost = "measured"
    #: Inductor's mode, for when ``options=`` are given (torch.compile refuses ``mode=`` with
    #: them): "reduce-overhead" records CUDA graphs.
    mode: Mode = "default"
    #: What compiles the rewritten graph: ``inductor`` (the product) or ``aot_eager``
    #: (runs the rewritten ATen graph op by op; for debugging and fast tests).
    compiler: Compiler = "inductor"
    #: Seconds a rank waits, at a compiled graph's first call, for the peers of its process groups
    #: to reach a graph with the same communication (not counting time they spend compiling).
    #: A peer that never arrives runs that code eagerly or skipped it: the group then runs its
    #: collectives as written, or stops with ``RankDisagreement`` if it already ran fused graphs.
    #: Keep it below the process group's timeout, which bounds the waiting peer's collective.
    agreement_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            _check_type(field.name, value, hints[field.name])
        kernels = valid_kernels()
        if self.kernel not in kernels:
            raise ValueError(f"tokenweave option 'kernel' must be one of {kernels}, got {self.kernel!r}")
        if self.comm_ctas < 1 or self.comm_ctas > 32:  # the kernels' signal-pad budget per channel
            raise ValueError(f"tokenweave option 'comm_ctas' must be in [1, 32], got {self.comm_ctas}")
        if self.split_threshold < 2:
            raise ValueError(f"tokenweave option 'split_threshold' must be >= 2 (two non-empty halves), "
                             f"got {self.split_threshold}")
        for name in ("split_at", "num_sms"):
            if getattr(self, name) < 0:
                raise ValueError(f"tokenweave option {name!r} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.agreement_timeout_s < float("inf"):
            raise ValueError(f"tokenweave option 'agreement_timeout_s' must be a positive number of seconds, "
                             f"got {self.agreement_timeout_s}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict[str, Any] | TokenWeaveConfig | None) -> TokenWeaveConfig:
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise TypeError(
                f"tokenweave options must be a dict or TokenWeaveConfig, got {type(options).__name__}"
            )
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise ValueError(
                f"unknown tokenweave option(s) {unknown}; valid keys: {cls.valid_keys()}"
            )
        return cls(**options)

    def cache_key(self) -> str:
        """A stable digest of every option, part of the Inductor FX-graph-cache key."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def valid_kernels() -> list[str]:
    """The values of the ``kernel`` option: ``auto`` and every registered implementation's name."""
    from weave_compile.kernels import registry  # (imported here: the registry loads the kernels)

    return [registry.AUTO, *registry.names()]


def _check_type(name: str, value: Any, hint: Any) -> None:
    allowed = get_args(hint)
    if allowed and all(isinstance(a, str) for a in allowed):  # a Literal of strings
        if value not in allowed:
            raise ValueError(f"tokenweave option {name!r} must be one of {list(allowed)}, got {value!r}")
        return
    # bool is a subclass of int: an int option given True is a mistake, not a 1.
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"tokenweave option {name!r} must be int, got {type(value).__name__} {value!r}")
    if hint is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"tokenweave option {name!r} must be float, got {type(value).__name__} {value!r}")
    if hint is bool and not isinstance(value, bool):
        raise TypeError(f"tokenweave option {name!r} must be bool, got {type(value).__name__} {value!r}")
