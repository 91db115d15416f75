"""The token split: TokenWeave's coarse split of every layer into a prefix (A) and a suffix (B),
each half's fused communication on a second stream while the other half computes.

Everything the split is lives in this package:

- :mod:`.options`: its options (:class:`.options.SplitOptions`, which ``weave_compile.Options``
  extends) and their checks;
- :mod:`.decision`: whether a graph is split, decided once, before the fuse pass, and handed to
  ``auto`` (which chooses each site's design for a split or an unsplit layer) and to the rewrite;
  ``split_threshold`` is compared there only;
- :mod:`.merge_projections`: the pre-pass on the Dynamo graph that runs sibling linears (q/k/v,
  gate/up) as one GEMM, so a half does not pay each small GEMM's fixed cost again;
- :mod:`.smart_split` and :mod:`.gemm_cost`: where to cut (the layer's GEMM waves, measured
  cuBLAS curves);
- :mod:`.split` (the post-grad pass), :mod:`.rewriter`, :mod:`.plan`, :mod:`.rules`,
  :mod:`.attention`, :mod:`.schedule`, :mod:`.values`: the rewrite itself.

Importing the package imports none of them (``weave_compile.Options`` reads :mod:`.options`
alone).
"""
