"""A mixture-of-experts layer on Purlin's variable-length all-to-all, checked against one device.

    PYTHONPATH=. python3 bench/moe.py [--ranks 4] [--tokens 64] [--hidden 128] [--ffn 256]
        [--experts 8] [--topk 2] [--datapath cpu|sm] [--out FOLDER_OR_FILE.json]

Every rank routes its tokens to the top-k of ``experts`` experts (a linear router, softmax
over the k picked), sends each (token, expert) row to the rank holding the expert
(``all_to_all_v``, the per-rank row counts a device tensor: no host sync), runs its experts'
MLPs (``relu(x W1) W2``) on what arrived, sends the results back with the received counts as
the new splits (the combine), and sums them weighted by the gates. The same layer computed on
one device in float64 from the same weights and tokens is the reference; the table says the
largest difference and how uneven the dispatch was.

``--datapath cpu`` (the default without a GPU) runs the ranks on ``Cluster.cpu(n)``; ``sm``
on ``Cluster.virtual(n)`` (n ranks on one GPU). Exit status 1 if any row is wrong.
"""

from __future__ import annotations

import argparse
import sys
import time

TOL = 1e-4  # float32 math against the float64 reference, relative to the output's scale


def weights(hidden, ffn, experts, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(hidden, experts, generator=g) / hidden ** 0.5,
            "w1": torch.randn(experts, hidden, ffn, generator=g) / hidden ** 0.5,
            "w2": torch.randn(experts, ffn, hidden, generator=g) / ffn ** 0.5}


def reference(xs, w, k):
    """The layer on one device, in float64: every token of every rank."""
    import torch

    x = torch.cat(xs).double()
    wr, w1, w2 = (w[name].double() for name in ("router", "w1", "w2"))
    top, idx = (x @ wr).topk(k, dim=1)
    gates = torch.softmax(top, dim=1)
    out = torch.zeros_like(x)
    for j in range(k):
        h = torch.relu(torch.einsum("th,thf->tf", x, w1[idx[:, j]]))
        out += gates[:, j:j + 1] * torch.einsum("tf,tfh->th", h, w2[idx[:, j]])
    return out


class MoE:
    """The layer on ``cluster``: three variable-length all-to-alls bound once (dispatch of
    the rows, of their expert ids, and the combine), each at the capacity of every row of a
    rank going to one rank."""

    def __init__(self, cluster, w, tokens, k, device):
        from purlin.spec.varlen import all_to_all_v

        n = cluster.nranks
        self.n, self.k, self.tokens, self.device = n, k, tokens, device
        self.w = {name: t.to(device) for name, t in w.items()}
        self.hidden = w["router"].shape[0]
        self.experts = w["router"].shape[1]
        self.per_rank = self.experts // n
        cap = tokens * k  # no token is dropped: one rank may send all its rows to one rank
        self.cap = cap
        rows = all_to_all_v(n, capacity=cap, row=self.hidden)
        self.dispatch = cluster.bind(rows, dtype="float32")
        self.ids = cluster.bind(all_to_all_v(n, capacity=cap), dtype="int32")
        self.combine = cluster.bind(rows, dtype="float32")

    def __call__(self, xs):
        import torch

        n, k, H, w = self.n, self.k, self.hidden, self.w
        sends, ids, orders, gates, splits = [], [], [], [], []
        for x in xs:
            top, idx = (x @ w["router"]).topk(k, dim=1)
            gates.append(torch.softmax(top, dim=1))
            flat = idx.reshape(-1)
            dest = flat // self.per_rank
            order = torch.argsort(dest * self.experts + flat, stable=True)
            orders.append(order)
            sends.append(x.repeat_interleave(k, dim=0)[order].reshape(-1))
            ids.append(flat[order].to(torch.int32))
            splits.append(torch.bincount(dest, minlength=n))
        counts = torch.stack(splits).reshape(-1)  # counts[r * n + j]: rows r sends to j
        recv, got = self.dispatch.launch(sends, counts)
        recv_ids, _ = self.ids.launch(ids, counts)
        back = []
        rows = torch.arange(n * self.cap, device=self.device)
        for j in range(n):
            x = recv[j].reshape(n * self.cap, H)
            e_ids = recv_ids[j][:n * self.cap].to(torch.int64)
            valid = rows < got[j].to(self.device).sum()
            y = torch.zeros_like(x)
            for local in range(self.per_rank):
                e = j * self.per_rank + local
                mine = ((e_ids == e) & valid).to(x.dtype)[:, None]
                y += mine * (torch.relu(x @ w["w1"][e]) @ w["w2"][e])
            back.append(y.reshape(-1))
        # what rank j got from rank i goes back to i: the combine's splits are the transpose
        combine_counts = torch.stack([g.to(self.device) for g in got]).reshape(-1)
        returned, _ = self.combine.launch(back, combine_counts)
        outs = []
        for r in range(n):
            rows_back = returned[r].reshape(-1, H)[:self.tokens * k]
            unsorted = torch.empty_like(rows_back)
            unsorted[orders[r]] = rows_back
            outs.append((unsorted.reshape(self.tokens, k, H) * gates[r][..., None]).sum(1))
        self.last_counts = counts
        return outs

    def check(self) -> None:
        for b in (self.dispatch, self.ids, self.combine):
            b.check()


def run(ranks=4, tokens=64, hidden=128, ffn=256, experts=8, k=2, datapath="cpu", repeats=5,
        seed=0, log=sys.stdout) -> dict:
    import torch

    from purlin.runtime import Cluster

    if experts % ranks:
        raise SystemExit(f"--experts {experts} must be a multiple of --ranks {ranks}")
    if datapath == "sm":
        cluster, device = Cluster.virtual(ranks), torch.device("cuda", 0)
    else:
        cluster, device = Cluster.cpu(ranks), torch.device("cpu")
    w = weights(hidden, ffn, experts, seed)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(ranks)]
    want = reference(xs, w, k)
    layer = MoE(cluster, w, tokens, k, device)
    outs = layer([x.to(device) for x in xs])
    layer.check()
    got = torch.cat([o.double().cpu() for o in outs])
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        layer([x.to(device) for x in xs])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    layer.check()
    counts = layer.last_counts.cpu().reshape(ranks, ranks)
    per_expert_rank = counts.sum(0).tolist()  # rows each rank's experts received
    mean = sum(per_expert_rank) / ranks
    row = {"ranks": ranks, "tokens_per_rank": tokens, "hidden": hidden, "ffn": ffn,
           "experts": experts, "topk": k, "datapath": datapath, "cluster": repr(cluster),
           "max_abs_error": err, "output_scale": scale,
           "rows_per_rank_received": per_expert_rank,
           "skew": max(per_expert_rank) / mean if mean else 0.0,
           "capacity_rows": layer.cap, "ms_per_layer": sorted(times)[len(times) // 2],
           "measured": "wall time per layer, eager (routing, 3 all-to-all-v, experts)",
           "status": "ok" if err <= TOL * max(scale, 1.0) else "WRONG"}
    if log is not None:
        print(f"{'ranks':>5} {'tokens':>6} {'experts':>7} {'k':>2} {'max |err|':>10} "
              f"{'skew':>5} {'ms/layer':>9}  rows received per rank", file=log)
        print(f"{ranks:>5} {tokens:>6} {experts:>7} {k:>2} {err:>10.2e} {row['skew']:>5.2f} "
              f"{row['ms_per_layer']:>9.2f}  {per_expert_rank}  {row['status']}", file=log)
    return row


def main(argv=None) -> int:
    from purlin.bench.scripts import output, run_info, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--datapath", default=None, choices=("cpu", "sm"),
                    help="sm: Cluster.virtual on one GPU (default where one is visible)")
    ap.add_argument("--out", default=None, help="a folder (default outputs/) or a .json file")
    args = ap.parse_args(argv)
    datapath = args.datapath
    if datapath is None:
        import torch

        datapath = "sm" if torch.cuda.is_available() else "cpu"
    row = run(args.ranks, args.tokens, args.hidden, args.ffn, args.experts, args.topk,
              datapath)
    path = write_json(output(args.out, "moe.json"),
                      {**row, "info": run_info(row["datapath"], measured=row["measured"])})
    print(f"wrote {path}")
    return 0 if row["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
