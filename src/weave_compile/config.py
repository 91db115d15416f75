"""Typed options of the ``tokenweave`` backend.

:class:`Options` is a frozen dataclass that checks every field when it is built: a wrong type
raises ``TypeError`` and an out-of-range value ``ValueError``, each naming the option, what it
accepts and what was given. Build one to validate options before compiling::

    opts = weave_compile.Options(kernel="p2p", split=True)   # raises here if wrong
    torch.compile(model, backend="tokenweave", options=opts)

``torch.compile`` hands ``options`` to the backend unchanged (it only pops its own keys from a
dict), so a plain dict works too: the backend turns it into :class:`Options` through
:meth:`Options.from_options`, which also rejects unknown keys with the list of valid ones (a
misspelt option must never be silently ignored). An unknown option is a ``TypeError`` either way,
as Python raises for an unexpected keyword argument: ``Options(kernal=...)`` and
``{"kernal": ...}`` fail alike. A dict is only seen when the first call
compiles; ``backend.py`` says how its errors reach the caller.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from weave_compile.kernels.spec import DEFAULT_COMM_CTAS, MAX_CTAS
from weave_compile.passes.split_tokens.options import SplitCost, SplitOptions

__all__ = ["Compiler", "Mode", "Options", "SplitCost", "TokenWeaveConfig", "valid_kernels"]

Compiler = Literal["inductor", "aot_eager"]
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclasses.dataclass(frozen=True)
class Options(SplitOptions):
    """Options of the ``tokenweave`` backend, checked when built (README.md lists them). The
    token split's own (``split``, ``split_threshold``, ...) are :class:`SplitOptions`' fields.

    ``dataclasses.replace(opts, split=False)`` gives a changed copy, checked again.
    """

    #: Rewrite ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` into one fused op.
    fuse: bool = True
    #: Keep the residual stream sharded by token rows between fused sites whose only
    #: consumer of the residual is the next fused site.
    shard_residual: bool = True
    #: Implementation of the fused op: ``auto`` (the policy of ``kernels/auto.py``: a design only
    #: where a measurement on today's kernels says it beats the plain graph, else the site as
    #: written) or the name of a registered implementation (``weave_compile.kernels.names()``),
    #: which forces it. A forced implementation that cannot run falls back, with the reason in
    #: ``explain()`` (on a GPU to compiled work or the site as written, ``kernels/auto.py``).
    kernel: str = "auto"
    #: With ``kernel="auto"``: measure, when a graph compiles, every implementation that can run at
    #: its sites and the sites as written, on this machine and the sites' own process group, and
    #: take the fastest (a design only where it beats the sites as written by more than the
    #: timing's spread, at least 2%); one answer for every rank, cached on disk under Inductor's
    #: cache directory and reused (``kernels/measured``). False: the shipped rules
    #: (``kernels/auto.py``), which take no design without a measurement across GPUs.
    autotune: bool = True
    #: Every fused site's output rows (normed and residual) bitwise the same whatever else is in
    #: the batch: the token count, the other rows, the split, the launch shape and the rank that
    #: owns a row. Only implementations that add the partial sums in one fixed order (rank 0, 1,
    #: ..., N-1, in fp32) run, one per site for every token count; a site the rules would leave
    #: as written stays so only where that is invariant too (two CPU ranks; on a GPU it gets
    #: ``nccl``), else compiling raises
    #: ``BatchInvariantError`` naming it (docs/kernels.md, "Batch invariance").
    batch_invariant: bool = False
    #: Let the ``p2p`` kernel leave its normed output in the symmetric output ring where the
    #: peers pushed it (no copy of their rows), wherever the ``output`` pass proves every reader
    #: runs before the ring slot is written again; elsewhere it is copied out as before, with the
    #: reason in ``explain()``. Off by default until its GPU tests have run (docs/performance.md).
    output_in_place: bool = False
    #: Thread blocks the fused communication may occupy beside other work (1-32; the barrier
    #: kernels' signal-pad budget): the most, the fastest where the op runs alone
    #: (docs/performance.md, section 2); TokenWeave uses 2-8 while overlapping.
    comm_ctas: int = DEFAULT_COMM_CTAS
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
        if self.comm_ctas < 1 or self.comm_ctas > MAX_CTAS:  # the kernels' signal-pad budget per channel
            raise ValueError(f"tokenweave option 'comm_ctas' must be in [1, {MAX_CTAS}], got {self.comm_ctas}")
        self.check_split()
        if not 0 < self.agreement_timeout_s < float("inf"):
            raise ValueError(f"tokenweave option 'agreement_timeout_s' must be a positive number of seconds, "
                             f"got {self.agreement_timeout_s}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def choices(cls, name: str) -> list[str] | None:
        """The values option ``name`` accepts where they are a fixed set of names (for a CLI's
        ``choices=``), else None."""
        if name == "kernel":  # the registry's names, not a Literal
            return valid_kernels()
        hint = get_type_hints(cls)[name]
        return list(get_args(hint)) if get_origin(hint) is Literal else None

    @classmethod
    def from_options(cls, options: dict[str, Any] | Options | None) -> Options:
        """``options`` as given to ``torch.compile``: None, a dict of fields, or an ``Options``."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"tokenweave options must be a dict or weave_compile.Options, got "
                            f"{type(options).__name__} {options!r}")
        message = _unknown_keys(options)
        if message:
            raise TypeError(message)  # as Options(**options) would: an unexpected keyword
        return cls(**options)

    def cache_key(self) -> str:
        """A stable digest of every option, part of the Inductor FX-graph-cache key."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


def valid_kernels() -> list[str]:
    """The values of the ``kernel`` option: ``auto`` and every registered implementation's name."""
    from weave_compile.kernels import registry  # (imported here: the registry loads the kernels)

    return [registry.AUTO, *registry.names()]


def _unknown_keys(given) -> str:
    """What is wrong with the option names in ``given`` (with a did-you-mean), "" if nothing."""
    valid = Options.valid_keys()
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return ""
    close = {k: difflib.get_close_matches(k, valid, n=1) for k in unknown}
    hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k, m in close.items() if m)
    return f"unknown tokenweave option(s) {unknown}{hints}; valid keys: {valid}"


def _checked_init(init):
    """``Options(kernal=...)``: the dataclass's own ``TypeError`` names the keyword only; this one
    says what the dict form says (the close option, every valid one). A ``TypeError``, as for any
    unexpected keyword argument, and as the dict form raises."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        message = _unknown_keys(kwargs)
        if message:
            raise TypeError(message)
        init(self, *args, **kwargs)

    return __init__


Options.__init__ = _checked_init(Options.__init__)

#: Backward-compatible name of :class:`Options`.
TokenWeaveConfig = Options


def _check_type(name: str, value: Any, hint: Any) -> None:
    """``TypeError`` unless ``value`` has the field's type; ``ValueError`` for a string outside a
    ``Literal``'s values. Generic over the type hint, so a new field needs no new code here."""
    if get_origin(hint) is Literal:
        allowed = list(get_args(hint))
        if not isinstance(value, str):
            raise TypeError(f"tokenweave option {name!r} must be str, one of {allowed}, got "
                            f"{type(value).__name__} {value!r}")
        if value not in allowed:
            raise ValueError(f"tokenweave option {name!r} must be one of {allowed}, got {value!r}")
        return
    if get_origin(hint) in (Union, types.UnionType):  # Optional[X]
        if value is None and type(None) in get_args(hint):
            return
        kinds = tuple(a for a in get_args(hint) if a is not type(None))
        hint = kinds[0] if len(kinds) == 1 else kinds
    # bool is a subclass of int: an int option given True is a mistake, not a 1; a float option
    # takes an int (a whole number of seconds is still a number of seconds).
    accepted = (int, float) if hint is float else hint
    wrong_bool = isinstance(value, bool) and hint is not bool
    if wrong_bool or not isinstance(value, accepted):
        want = hint.__name__ if isinstance(hint, type) else " or ".join(h.__name__ for h in hint)
        raise TypeError(f"tokenweave option {name!r} must be {want}, got {type(value).__name__} {value!r}")
