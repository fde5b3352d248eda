"""A group that spans nodes: SNAC inside each node, the group's own backend between nodes.

:class:`Hierarchy` runs a :func:`purlin.snac.hierarchical.plan_hierarchical` plan: its intra
phases on a Purlin communicator of the node's ranks, its inter phases on ``torch.distributed``
subgroups of the ranks with the same local index (NCCL on GPUs, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from purlin.errors import PlanError
from purlin.snac.hierarchical import Intra, nodes_of, plan_hierarchical
from purlin.spec import collectives
from purlin.torch.common import capturing, dtype_name, gather_into, scatter_into, torch_op


class Hierarchy:
    """Runs split collectives: intra phases on a Purlin communicator of the node, inter phases
    on ``torch.distributed`` subgroups of the ranks with the same local index."""

    def __init__(self, comm):
        self.comm = comm
        nodes = nodes_of(comm.node_of_rank)
        if len({len(r) for r in nodes}) != 1:
            raise PlanError("a communicator spanning nodes needs the same number of ranks on "
                            f"every node; got {[len(r) for r in nodes]}")
        self.plan_nodes = nodes
        L = len(nodes[0])
        g = comm.global_ranks
        node_groups = [list(ranks) for ranks in nodes]
        inter_groups = [sorted(ranks[i] for ranks in nodes) for i in range(L)]
        # every process of the world creates every group (in the same order), unless the
        # communicator's group is a subgroup: then members create theirs locally
        local = comm.group is not dist.group.WORLD
        self.node_group = self.inter_group = None
        for is_node, ranks in [(True, r) for r in (node_groups if L > 1 else [])] + \
                [(False, r) for r in inter_groups]:
            member = comm.rank in ranks
            if local and not member:
                continue
            members = [g[r] for r in ranks]
            pg = (dist.new_group(members, use_local_synchronization=True) if local
                  else dist.new_group(members))
            if member and is_node:
                self.node_group = pg
            elif member:
                self.inter_group = pg
        self.nodes = len(nodes)
        self.intra = None
        if L > 1:
            # the intra phases read and write the hierarchy's own buffers: no zero copy
            options = replace(comm.options, zero_copy=False, epilogue_grid=None,
                              epilogue_kernel="auto")
            self.intra = type(comm)(self.node_group, comm.datapath, comm.timeout,
                                    options=options, node_of_rank=[0] * L)
            self.device = self.intra.device
            self.dtypes = self.intra.path.dtypes
        else:
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if comm.datapath == "sm" else torch.device("cpu")
            self.dtypes = tuple(str(t).removeprefix("torch.") for t in (
                torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32,
                torch.int64))
        self.plans: dict = {}
        self.mids: dict = {}

    def run(self, kind: str, op: str, src, dst, count: int) -> str | None:
        """Run a split collective (``count``: the flat message in elements); a string says why
        it could not (before ``dst`` was written: only the last phase writes it)."""
        comm = self.comm
        if not (src.is_contiguous() and dst.is_contiguous()):
            return "non-contiguous tensor across nodes"
        hp = self.plans.get((kind, op))
        if hp is None:
            flat_coll = collectives.standard(kind, comm.nranks, op=op if op != "copy" else "sum")
            hp = self.plans[(kind, op)] = plan_hierarchical(flat_coll, comm.node_of_rank)
        key = (kind, op, count, src.dtype)
        state = self.mids.get(key)
        if state is None:
            if capturing():
                return "first call of this size inside a CUDA graph capture"
            flat = hp.flat_sizing(count, dtype=dtype_name(src))
            mid = hp.buffer_counts(flat, comm.rank)["mid"]
            state = self.mids[key] = (flat, torch.empty(mid, dtype=src.dtype, device=self.device))
        flat, mid = state
        bufs = {"input": src.reshape(-1), "mid": mid, "output": dst.reshape(-1)}
        local = hp.local_rank(comm.rank)
        for phase in hp.phases:
            if isinstance(phase, Intra):
                sz = hp.phase_sizing(phase, flat)
                why = self.intra._run_sized(phase.collective, sz,
                                            bufs[phase.src][:sz.input_count(local)],
                                            bufs[phase.dst][:sz.output_count(local)])
                if why:  # every rank stops at the same phase; only the last one writes dst
                    return why
            else:
                self._inter(phase, bufs)
        return None

    def _inter(self, phase, bufs) -> None:
        """One inter-node phase on the subgroup of this rank's local index (buffers are sized
        exactly for it: the mid buffer by the plan, input and output by the user)."""
        src, dst = bufs[phase.src], bufs[phase.dst]
        op = torch_op("sum" if phase.op in ("avg", "copy") else phase.op)
        if phase.collective == "all-reduce":
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            dist.all_reduce(dst, op=op, group=self.inter_group)
        elif phase.collective == "all-gather":
            gather_into(dst, src, group=self.inter_group)
        else:
            scatter_into(dst, src, op=op, group=self.inter_group)
        if phase.op == "avg":  # an average of equal-sized nodes' averages
            dst.div_(self.nodes)
