#!/usr/bin/env python3
"""Context parallelism on GPUs (issue 15): `bsattn.distributed.attention` on N GPUs against the
one-GPU `bsattn.attention` of the whole problem, and the key/value bytes each rank receives
against what an all-gather would move. Needs the Python package with the GPU engine
(tests/python/device_run.sh builds it) and one process per GPU:

  torchrun --nproc_per_node=2 bench/gpu/bench_distributed.py [--seq 131072] [--rows rand0.1,causal,local0.1]

bf16, Hq 32 / Hkv 8, D 128, blocks of 128. Rows: ``rand0.1`` (a random pattern per query head at
density 0.1), ``causal``, ``local0.1`` (each query block sees the 10 % of key blocks just before
it: a local pattern). Every rank draws the whole problem from one seed and keeps its zigzag
shard; rank 0 also runs the one-GPU call, checks every rank's rows against it (relative L2 error)
and prints the table. Times: median of --iters CUDA-event timings with a barrier before each.
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist

import bsattn
import bsattn.distributed as bd

P = argparse.ArgumentParser()
P.add_argument("--seq", type=int, default=131072)
P.add_argument("--rows", default="rand0.1,causal,local0.1")
P.add_argument("--iters", type=int, default=10)
P.add_argument("--layout", default="zigzag")
ARGS = P.parse_args()
HQ, HKV, D, BLOCK = 32, 8, 128, 128

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))


def timed(fn):
    times = []
    for _ in range(ARGS.iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def pattern(name, nb, gen):
    idx = torch.arange(nb, device="cuda")
    if name == "causal":
        return None
    if name.startswith("rand"):
        return torch.rand(1, HQ, nb, nb, generator=gen, device="cuda") < float(name[4:])
    width = max(1, int(float(name[5:]) * nb))  # local: the `width` key blocks up to the diagonal
    band = (idx[:, None] - idx[None, :] >= 0) & (idx[:, None] - idx[None, :] < width)
    return band[None, None].expand(1, HQ, nb, nb)


rows = []
for name in ARGS.rows.split(","):
    gen = torch.Generator(device="cuda").manual_seed(0)
    S, nb = ARGS.seq, ARGS.seq // BLOCK
    q = torch.randn(1, S, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(1, S, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(1, S, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    blocks = pattern(name, nb, gen)
    causal = name == "causal"
    chunks = bd.Chunks(ARGS.layout, world, S // world)
    tokens = torch.cat([torch.arange(c * chunks.size, (c + 1) * chunks.size, device="cuda")
                        for c in chunks.of_rank(rank)])
    qs, ks, vs = (t[:, tokens].contiguous() for t in (q, k, v))
    local = None if blocks is None else blocks[:, :, tokens[::BLOCK] // BLOCK].contiguous()
    call = lambda: bd.attention(qs, ks, vs, local, block_size=BLOCK, causal=causal, layout=ARGS.layout,  # noqa: E731
                                validate=False, return_stats=True)
    out, stats = call()
    ms = timed(call)
    gathered = [torch.empty_like(out) for _ in range(world)] if rank == 0 else None
    all_tokens = [torch.empty_like(tokens) for _ in range(world)] if rank == 0 else None
    dist.gather(out, gathered, dst=0)
    dist.gather(tokens, all_tokens, dst=0)
    moved = [None] * world
    dist.all_gather_object(moved, (stats["bytes_received"], stats["all_gather_bytes"]))
    if rank == 0:
        sparsity = None if blocks is None else bsattn.from_dense_block_mask(blocks, BLOCK)
        single = lambda: bsattn.attention(q, k, v, sparsity, mask=bsattn.Mask(causal=causal),  # noqa: E731
                                          validate=False)
        ref = single()
        one = timed(single)
        err = max(((o.float() - ref[:, t].float()).norm() / ref[:, t].float().norm()).item()
                  for o, t in zip(gathered, all_tokens))
        received = max(r for r, _ in moved) / 1e6
        gathered_mb = moved[0][1] / 1e6
        rows.append(f"| {name} | {one:.3f} | {ms:.3f} | {one / ms:.2f} | {received:.0f} | {gathered_mb:.0f} | "
                    f"{received / gathered_mb:.2f} | {err:.1e} |")
    else:
        for _ in range(ARGS.iters + 2):  # the barriers of rank 0's one-GPU timing
            dist.barrier()

if rank == 0:
    print(f"{world} GPUs ({torch.cuda.get_device_name()}), S = {ARGS.seq}, Hq {HQ} / Hkv {HKV}, D {D}, bf16, "
          f"blocks {BLOCK}, {ARGS.layout} shards")
    print("| row | one GPU ms | distributed ms | speed-up | MB received (max rank) | MB an all-gather moves | "
          "ratio | rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
dist.destroy_process_group()
