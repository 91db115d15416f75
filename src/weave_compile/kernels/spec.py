"""The fused op's arguments, as the implementations receive them: a frozen spec and the rows.

:class:`FusedSpec` holds every non-tensor argument of ``weave::allreduce_add_rmsnorm`` (dtypes,
eps, flags, CTAs; their meaning: ``ops/allreduce_rmsnorm.py``). It is built and
validated once, where the op is called, and handed down unchanged to the implementation and
its launchers. :class:`Rows` is the one adapter between the op's tensors (any leading dims) and
the ``[T, H]`` rows every implementation works on, and back.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from weave_compile.quant import QuantSpec
from weave_compile.rows import NORMS

#: Thread blocks the fused communication may occupy at most: the signal slots each channel of a
#: symmetric workspace reserves per rank.
MAX_CTAS = 32
#: ``comm_ctas`` when nothing says otherwise: the backend option's default and a direct call's,
#: so both launch the same grid (the op is fastest alone at the most CTAs, docs/performance.md).
DEFAULT_COMM_CTAS = MAX_CTAS


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """The op's non-tensor arguments. ``comm_ctas``: thread blocks the communication may occupy
    (the barrier kernels' signal-pad budget bounds it); ``out_slot`` >= 0: leave ``normed`` in
    that slot of the symmetric output ring (implementations that take it), -1: a fresh tensor.
    ``group_name`` may be empty for a launch on a prepared (emulated) workspace. ``beside_compute``:
    the op runs on a second stream beside the model's own kernels (the split's start op), so a
    local kernel of an implementation keeps to ``comm_ctas`` CTAs; otherwise nothing runs beside
    it and a local kernel takes as many CTAs as its rows fill (a kernel of few CTAs alone is
    slower than Inductor's own add+norm, docs/performance.md). ``norm``: ``"rmsnorm"`` or
    ``"layernorm"`` (the row's mean subtracted first; only implementations with
    ``takes_layernorm`` are handed one, and only they get a post-norm bias, ``Rows.norm_bias``).
    ``quant``: the fp8 epilogue (:class:`weave_compile.quant.QuantSpec`; None: none), handed only to
    implementations with ``takes_quant``; its static scale is ``Rows.quant_scale``."""

    residual_dtype: torch.dtype
    out_dtype: torch.dtype
    eps: float = 1e-6
    group_name: str = ""
    mid_dtype: Optional[torch.dtype] = None
    weight_offset: float = 0.0
    residual_in_sharded: bool = False
    residual_out_sharded: bool = False
    comm_ctas: int = DEFAULT_COMM_CTAS
    out_slot: int = -1
    beside_compute: bool = False
    norm: str = "rmsnorm"
    batch_invariant: bool = False  # add the partial sums in rank order in fp32 (ops/allreduce_rmsnorm.py)
    quant: Optional[QuantSpec] = None

    def __post_init__(self) -> None:
        for name in ("residual_dtype", "out_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {getattr(self, name)!r}")
        if self.mid_dtype is not None and not isinstance(self.mid_dtype, torch.dtype):
            raise TypeError(f"mid_dtype must be a torch.dtype or None, got {self.mid_dtype!r}")
        if isinstance(self.comm_ctas, bool) or not isinstance(self.comm_ctas, int) \
                or not 1 <= self.comm_ctas <= MAX_CTAS:
            raise ValueError(f"comm_ctas must be an int in [1, {MAX_CTAS}], got {self.comm_ctas!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.out_slot < -1:
            raise ValueError(f"out_slot must be -1 (a fresh output) or a ring slot >= 0, got {self.out_slot}")

    @classmethod
    def for_rows(cls, x: torch.Tensor, residual: Optional[torch.Tensor] = None, **kw) -> "FusedSpec":
        """A spec for a direct call on ``x`` (and ``residual``): the residual output keeps the
        residual's dtype (else x's), the normed output x's, unless ``kw`` says otherwise."""
        if kw.get("residual_dtype") is None:
            kw["residual_dtype"] = residual.dtype if residual is not None else x.dtype
        if kw.get("out_dtype") is None:
            kw["out_dtype"] = x.dtype
        return cls(**kw)


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """The op's tensors as rows: ``x`` [T, H] (this rank's partial sums), ``residual`` [T, H] or,
    with a sharded residual, this rank's [S, H] shard, ``bias`` and ``weight`` [H], ``scale`` and
    ``eps_tensor`` 0-d (``eps_tensor`` only for implementations that read eps from a tensor),
    ``norm_bias`` [H] (added after the norm's weight: a LayerNorm's bias; not ``bias``, which is
    added to the reduced sum before the norm).
    ``shape`` is the op input's shape, which :meth:`restore` gives the outputs back."""

    x: torch.Tensor
    residual: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    eps_tensor: Optional[torch.Tensor] = None
    shape: tuple = ()
    norm_bias: Optional[torch.Tensor] = None
    quant_scale: Optional[torch.Tensor] = None  # the fp8 epilogue's static scale (0-d or one element)

    @classmethod
    def of(cls, x: torch.Tensor, residual: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
           weight: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
           eps_tensor: Optional[torch.Tensor] = None, norm_bias: Optional[torch.Tensor] = None,
           quant_scale: Optional[torch.Tensor] = None) -> "Rows":
        """Views of the op's tensors as rows. A sharded residual is this rank's rows in any shape
        with ``H`` last (the shard pass hands on ``[S, H]``, a sequence-parallel model its own
        ``[B, S/N, H]`` or ``[S/N, B, H]``)."""
        hidden = x.shape[-1]
        for name, t in (("bias", bias), ("weight", weight), ("norm_bias", norm_bias)):
            if t is not None and t.numel() != hidden:
                raise ValueError(f"{name} must have {hidden} elements (one per hidden column), "
                                 f"got shape {tuple(t.shape)}")
        if quant_scale is not None and quant_scale.numel() != 1:
            raise ValueError(f"quant_scale must have one element (a static per-tensor scale), "
                             f"got shape {tuple(quant_scale.shape)}")
        if residual is not None:
            residual = residual.reshape(-1, hidden)
        return cls(x.reshape(-1, hidden), residual, None if bias is None else bias.reshape(hidden),
                   None if weight is None else weight.reshape(hidden), scale, eps_tensor, tuple(x.shape),
                   None if norm_bias is None else norm_bias.reshape(hidden), quant_scale)

    def eps(self, spec: FusedSpec):
        """The norm's eps: ``eps_tensor`` where given (0-d, read where it lives), else ``spec.eps``."""
        return spec.eps if self.eps_tensor is None else self.eps_tensor

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    def restore(self, normed: torch.Tensor, residual_out: torch.Tensor, residual_out_sharded: bool,
                scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The outputs in the op input's shape (a sharded residual output stays [S, H]); ``scales``
        (an fp8 epilogue's per-row scales, [T, 1]) as ``[..., 1]``, or empty where there are none."""
        shape = self.shape or tuple(self.x.shape)
        if scales is None or scales.numel() == 0:
            scales = self.x.new_empty((0,), dtype=torch.float32)
        else:
            scales = scales.reshape(*shape[:-1], 1)
        return (normed.reshape(shape), (residual_out if residual_out_sharded else residual_out.reshape(shape)),
                scales)
