"""Spec layer: what a collective means (ARCHITECTURE.md, "Spec").

>>> from purlin.spec import collectives, reference
>>> collectives.all_gather(3).output[2]
(0, 1, 2)
"""

from purlin.spec import collectives
from purlin.spec.collective import Collective
from purlin.spec.collectives import STANDARD, standard
from purlin.spec.dtypes import DTYPES, DType, dtype
from purlin.spec.layout import Layout
from purlin.spec.ops import Op, copy, reduce
from purlin.spec.reference import reference
from purlin.spec.sizing import Sizing, size
from purlin.spec.varlen import VarLen, all_gather_v, all_to_all_v, reduce_scatter_v

__all__ = [
    "Collective", "DType", "DTYPES", "Layout", "Op", "STANDARD", "Sizing", "collectives",
    "copy", "dtype", "reduce", "reference", "size", "standard", "VarLen", "all_gather_v",
    "all_to_all_v", "reduce_scatter_v",
]
