#!/usr/bin/env python3
"""PyTorch baseline for `cargo xtask bench`.

The same LoRA ops as the kernels section, written the way a PyTorch user
would: decode as gather + bmm (`A[idx]`, `B[idx]`), prefill as a loop of
matmuls over the segments. Timed like the Rust bench: captured once in a CUDA
graph, L2 flushed (by reading a buffer of 4x L2) before each replay, device
events around each replay, median of many. And in a graph, as the Rust bench
does when the shape carries "in_graph": {"sets", "ops"}: the op captured
`ops` times in one graph over `sets` copies of its inputs (a pass streams at
least 4x L2, so every op starts cold), replayed back to back, the median of
replay time / ops. Writes {name: {"median_us": ..., "in_graph_us": ...}}.

Shapes of kind "base_step" (the Rust bench's `step` section) are the base
projections of one whole decode step: for every layer and site (qkv, o,
gate_up, down), `x[n, in] @ W.T` with W `[out, in]` in bf16 as a checkpoint
stores it (what nn.Linear runs; cuBLAS through torch.matmul), every layer
its own weights, each site a fixed input and output buffer; the whole step
captured in one graph and timed like the isolated ops (L2 flushed before
each replay). Their weights are made once and shared by every n.
"""
import argparse
import json

import torch


def capture(fns, ops):
    """Warm every fn up on a side stream, then capture `ops` calls (call i
    runs fns[i % len(fns)]) in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(ops):
            fns[i % len(fns)]()
    return graph


def median_replay_us(graph, reps, before=None):
    """Median µs of `reps` replays of `graph` after two warm ones, each after
    `before()` (outside the events)."""
    for _ in range(2):
        graph.replay()
    pairs = []
    for _ in range(reps):
        if before is not None:
            before()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
    return us[len(us) // 2]


def time_graph(fn, reps, flush_buf):
    """One call per graph, the L2 flushed (by reading flush_buf) before each replay."""
    return median_replay_us(capture([fn], 1), reps, before=flush_buf.sum)


def time_in_graph(fns, ops, reps):
    """Per-op µs of `ops` calls (call i runs fns[i % len(fns)]) captured in
    one graph and replayed back to back, median over replays."""
    return median_replay_us(capture(fns, ops), max(25, (reps + 3) // 4)) / ops


def decode_op(s, dev):
    n, k, o, r, d = s["n"], s["in"], s["out"], s["r"], s["distinct"]
    # Several targets (q, k, v): each its own adapters, outputs side by side in y.
    tg = s.get("targets", 1)
    a = [(torch.rand(d, r, k, device=dev) * 2 - 1).mul_(k ** -0.5).to(torch.bfloat16) for _ in range(tg)]
    b = [(torch.rand(d, o, r, device=dev) * 2 - 1).mul_(r ** -0.5).to(torch.bfloat16) for _ in range(tg)]
    scale = [(torch.rand(d, device=dev) + 0.5).to(torch.bfloat16) for _ in range(tg)]
    x = (torch.rand(n, k, device=dev) * 2 - 1).to(torch.bfloat16)
    y = (torch.rand(n, o * tg, device=dev) * 2 - 1).to(torch.bfloat16)
    idx = torch.arange(n, device=dev) % d

    def fn():
        for i in range(tg):
            t = torch.bmm(a[i].index_select(0, idx), x.unsqueeze(2))
            delta = torch.bmm(b[i].index_select(0, idx), t).squeeze(2)
            y[:, i * o:(i + 1) * o].add_(delta * scale[i].index_select(0, idx).unsqueeze(1))

    return fn


def prefill_op(s, dev):
    n, segs, k, o, r = s["n"], s["segments"], s["in"], s["out"], s["r"]
    a = (torch.rand(segs, r, k, device=dev) * 2 - 1).mul_(k ** -0.5).to(torch.bfloat16)
    b = (torch.rand(segs, o, r, device=dev) * 2 - 1).mul_(r ** -0.5).to(torch.bfloat16)
    scale = [0.5 + i / segs for i in range(segs)]
    x = (torch.rand(n, k, device=dev) * 2 - 1).to(torch.bfloat16)
    y = (torch.rand(n, o, device=dev) * 2 - 1).to(torch.bfloat16)
    cuts = [i * n // segs for i in range(segs + 1)]

    def fn():
        for i in range(segs):
            lo, hi = cuts[i], cuts[i + 1]
            y[lo:hi].add_((x[lo:hi] @ a[i].t()) @ b[i].t(), alpha=scale[i])

    return fn


def base_step_weights(s, dev):
    """Every layer's weights of a base step, [out, in] bf16, uniform in
    +-1/sqrt(in) (random: zeros run faster)."""
    return [
        [torch.empty(site["out"], site["in"], device=dev, dtype=torch.bfloat16).uniform_(-1, 1).mul_(site["in"] ** -0.5)
         for site in s["sites"]]
        for _ in range(s["layers"])
    ]


def base_step_op(s, dev, weights):
    """The base projections of one decode step of n rows over `weights`."""
    n = s["n"]
    xs = [(torch.rand(n, site["in"], device=dev) * 2 - 1).to(torch.bfloat16) for site in s["sites"]]
    ys = [torch.empty(n, site["out"], device=dev, dtype=torch.bfloat16) for site in s["sites"]]

    def fn():
        for layer in weights:
            for w, x, y in zip(layer, xs, ys):
                torch.matmul(x, w.t(), out=y)

    return fn


def base_steps(shapes, reps, flush_buf, dev, results):
    """Time every base_step shape; a failure leaves its entry out (the Rust
    side then reports its ratio as not measured)."""
    weights, key = None, None
    for s in shapes:
        try:
            geometry = (s["layers"], tuple((site["in"], site["out"]) for site in s["sites"]))
            if geometry != key:
                weights, key = None, None
                torch.cuda.empty_cache()
                weights, key = base_step_weights(s, dev), geometry
            fn = base_step_op(s, dev, weights)
            us = time_graph(fn, reps, flush_buf)
            results[s["name"]] = {"median_us": us}
            gb = sum(site["in"] * site["out"] for site in s["sites"]) * s["layers"] * 2 / 1e9
            print(f"torch base step {s['name']}: {us:.1f} us ({gb:.2f} GB of weights, "
                  f"{gb * 1e6 / us:.0f} GB/s)", flush=True)
            del fn
        except (RuntimeError, KeyError, ValueError) as e:
            print(f"torch base step {s.get('name')}: not measured: {e}", flush=True)
    del weights
    torch.cuda.empty_cache()


def matrix_rate(dev):
    """The bf16 matrix rate of this card, TFLOP/s: an 8192^3 product on
    random data (zeros run faster), median of 20 after warm-up."""
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)[len(times) // 2]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", required=True, help="JSON list of shapes from the Rust bench")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 60 << 20)
    flush_buf = torch.empty(4 * l2 // 4, dtype=torch.float32, device=dev).uniform_()
    results = {}
    shapes = json.loads(args.shapes)
    for s in shapes:
        if s["kind"] == "base_step":
            continue
        make = decode_op if s["kind"] == "decode" else prefill_op
        fn = make(s, dev)
        us = time_graph(fn, args.reps, flush_buf)
        results[s["name"]] = {"median_us": us}
        del fn
        line = f"torch {s['name']}: {us:.2f} us"
        rot = s.get("in_graph")
        if rot:
            fns = [make(s, dev) for _ in range(rot["sets"])]
            ig = time_in_graph(fns, rot["ops"], args.reps)
            results[s["name"]]["in_graph_us"] = ig
            line += f", in a graph of {rot['ops']} over {rot['sets']} input copies: {ig:.2f} us"
            del fns
        print(line, flush=True)
        torch.cuda.empty_cache()
    base_steps([s for s in shapes if s["kind"] == "base_step"], args.reps, flush_buf, dev, results)
    results["__matrix_rate__"] = {"tflops": matrix_rate(dev)}
    print(f"torch bf16 8192^3 matmul: {results['__matrix_rate__']['tflops']:.0f} TFLOP/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
