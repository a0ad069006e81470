"""bsattn.distributed (issue 15) on CPU processes: 2 and 4 ranks, each holding a shard of Q, K, V
(contiguous or zigzag chunks), against the single-process call on the whole sequence: random
block patterns per head, causal, packed documents (varlen), empty rows; and the bytes moved with a
local pattern. Ranks talk through pipes (a `bsattn.distributed.Exchange`-shaped object on NumPy
arrays), and through torch.distributed's gloo backend where PyTorch is installed.
"""
import multiprocessing as mp
import threading

import numpy as np
import pytest

import bsattn
import bsattn.distributed as bd

CTX = mp.get_context("spawn")


class PipeGroup:
    """The communication interface of bsattn.distributed over a full mesh of pipes."""

    def __init__(self, rank, world, ends):
        self.rank, self.world, self._ends = rank, world, ends  # ends[peer]: this rank's end to peer

    def all_gather(self, obj):
        for peer, end in self._ends.items():
            end.send(obj)
        return [obj if peer == self.rank else self._ends[peer].recv() for peer in range(self.world)]

    def exchange(self, sends, recvs):
        def send_all():  # a pipe send blocks until the peer reads: in a thread, as a posted send
            for peer, chunk, k, v in sends:
                self._ends[peer].send((chunk, np.ascontiguousarray(k), np.ascontiguousarray(v)))

        sender = threading.Thread(target=send_all)
        sender.start()

        def arrivals():
            for peer, chunk, _, _ in recvs:
                got, k, v = self._ends[peer].recv()
                assert got == chunk
                yield chunk, k, v
            sender.join()

        return arrivals()


def global_case(seed, *, batch, seq, hq, hkv, dim, block, density, causal, documents):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, hq, dim), dtype=np.float32)
    k = rng.standard_normal((batch, seq, hkv, dim), dtype=np.float32)
    v = rng.standard_normal((batch, seq, hkv, dim), dtype=np.float32)
    nb = seq // block
    if density is None:
        blocks = None
    elif density == "band":  # each query block sees itself and the 2 blocks before it
        idx = np.arange(nb)
        blocks = ((idx[:, None] - idx[None, :] >= 0) & (idx[:, None] - idx[None, :] <= 2))[None, None]
    else:
        blocks = rng.random((1, hq, nb, nb)) < density
        blocks[:, :, 1, :] = False  # an empty row
    cu = None
    if documents is True:
        cuts = np.sort(rng.choice(np.arange(1, seq), size=5, replace=False))
        cu = np.concatenate([[0], cuts, [seq]]).astype(np.int32)
    elif documents:  # that many documents of equal length
        cu = np.linspace(0, seq, documents + 1).astype(np.int32)
    return q, k, v, blocks, cu


def reference(q, k, v, blocks, cu, block, causal):
    mask = bsattn.Mask(causal=causal)
    sparsity = None if blocks is None else bsattn.from_dense_block_mask(blocks, (block, block))
    if cu is not None and blocks is None:  # the varlen call on the packed documents
        out, lse = bsattn.attention(q[0], k[0], v[0], mask=mask, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
        return out[None], lse[None]
    if cu is not None:  # with a block pattern: document ids on the one sequence
        ids = np.repeat(np.arange(len(cu) - 1, dtype=np.int32), np.diff(cu))[None]
        mask = bsattn.Mask(causal=causal, doc_ids=(ids, ids))
    return bsattn.attention(q, k, v, sparsity, mask=mask, return_lse=True)


def as_format(blocks, block, fmt):
    """The rank's dense block rows [1, Hs, nQB, nKB] in another batched format."""
    if fmt == "lists":
        return bsattn.from_dense_block_mask(blocks, (block, block))
    if fmt == "bitmask":
        nkb = blocks.shape[-1]
        padded = np.zeros(blocks.shape[:-1] + (32 * ((nkb + 31) // 32),), bool)
        padded[..., :nkb] = blocks
        words = (padded.reshape(*blocks.shape[:-1], -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
        return bsattn.Bitmask(words.astype(np.uint32), block_size=(block, block))
    if fmt == "bsr":
        flat = blocks.reshape(-1, blocks.shape[-1])
        indptr = np.concatenate([[0], np.cumsum(flat.sum(1))]).astype(np.int32)
        indices = np.nonzero(flat)[1].astype(np.int32)
        return bsattn.BSR(indptr, indices, block_size=(block, block), heads=blocks.shape[1], batch=1)
    return blocks


class Shard:
    """One rank's part of a case: its tokens and block rows, its inputs, the reference rows."""

    def __init__(self, case, rank, world):
        self.q, self.k, self.v, self.blocks, self.cu = global_case(**case["inputs"])
        self.block, self.causal, self.layout = case["inputs"]["block"], case["inputs"]["causal"], case["layout"]
        self.varlen_layout = case.get("varlen_layout", False)
        chunks = bd.Chunks(self.layout, world, self.q.shape[1] // world)
        mine = chunks.of_rank(rank)
        self.tokens = np.concatenate([np.arange(c * chunks.size, (c + 1) * chunks.size) for c in mine])
        step = chunks.size // self.block
        self.rows = np.concatenate([np.arange(c * step, (c + 1) * step) for c in mine])

    def inputs(self):
        qkv = [t[:, self.tokens] for t in (self.q, self.k, self.v)]
        return [t[0] for t in qkv] if self.varlen_layout else qkv

    def local_blocks(self, fmt=None):
        return None if self.blocks is None else as_format(self.blocks[:, :, self.rows, :], self.block, fmt)

    def reference_backward(self, dout):
        """The single-process gradients of the whole problem for the loss gradient dout."""
        out, lse = reference(self.q, self.k, self.v, self.blocks, self.cu, self.block, self.causal)
        mask = bsattn.Mask(causal=self.causal)
        if self.cu is not None and self.blocks is None:
            grads = bsattn.attention_backward(self.q[0], self.k[0], self.v[0], out[0], lse[0], dout[0], mask=mask,
                                              cu_seqlens_q=self.cu, cu_seqlens_k=self.cu)
            return out, lse, [g[None] for g in grads]
        if self.cu is not None:
            ids = np.repeat(np.arange(len(self.cu) - 1, dtype=np.int32), np.diff(self.cu))[None]
            mask = bsattn.Mask(causal=self.causal, doc_ids=(ids, ids))
        sparsity = None if self.blocks is None else bsattn.from_dense_block_mask(self.blocks, (self.block, self.block))
        return out, lse, bsattn.attention_backward(self.q, self.k, self.v, out, lse, dout, sparsity, mask=mask)

    def check(self, out, lse):
        ref_out, ref_lse = reference(self.q, self.k, self.v, self.blocks, self.cu, self.block, self.causal)
        ref_out, ref_lse = ref_out[:, self.tokens], ref_lse[:, :, self.tokens]
        if self.varlen_layout:
            ref_out, ref_lse = ref_out[0], ref_lse[0]
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def reported(rank, results, body):
    """Runs body() in a rank and puts (rank, error or None, its result) for the parent."""
    try:
        results.put((rank, None, body()))
    except Exception as e:
        import traceback

        results.put((rank, f"{e!r}\n{traceback.format_exc()}", None))


def worker(rank, world, ends, case, results):
    def body():
        s = Shard(case, rank, world)
        group = PipeGroup(rank, world, ends)
        blocks = s.local_blocks(case.get("format"))
        keywords = dict(block_size=(s.block, s.block), causal=s.causal, cu_seqlens=s.cu, layout=s.layout, group=group)
        out, lse, stats = bd.attention(*s.inputs(), blocks, return_lse=True, return_stats=True, **keywords)
        s.check(out, lse)
        if case.get("backward"):
            dout = np.random.default_rng(case["inputs"]["seed"] + 1).standard_normal(s.q.shape, dtype=np.float32)
            full_out, full_lse, want = s.reference_backward(dout)
            local = lambda t: t[:, s.tokens][0] if s.varlen_layout else t[:, s.tokens]  # noqa: E731
            got = bd.attention_backward(*s.inputs(), out, lse, local(dout), blocks, **keywords)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert g.shape == local(w).shape, name
                np.testing.assert_allclose(g, local(w), rtol=2e-4, atol=5e-5, err_msg=name)
        return stats

    reported(rank, results, body)


def spawn_ranks(world, target, args_of_rank):
    """Runs target(rank, world, *args_of_rank(rank), results) in `world` processes; returns the
    ranks' results by rank and fails with every rank's error."""
    results = CTX.Queue()
    procs = [CTX.Process(target=target, args=(r, world, *args_of_rank(r), results)) for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=240) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}: {e}" for r, e, _ in got if e]
    assert not errors, "\n".join(errors)
    return {r: s for r, _, s in got}


def run_ranks(world, case):
    ends = {r: {} for r in range(world)}
    for a in range(world):
        for b in range(a + 1, world):
            ends[a][b], ends[b][a] = CTX.Pipe()
    return spawn_ranks(world, worker, lambda r: (ends[r], case))


def case(seed, layout, *, density=0.4, causal=False, documents=False, world=2, hq=4, hkv=2, batch=1, fmt=None,
         varlen_layout=False, backward=False):
    seq = 512 if world == 2 else 1024
    return {"layout": layout, "format": fmt, "varlen_layout": varlen_layout, "backward": backward,
            "inputs": dict(seed=seed, batch=batch, seq=seq, hq=hq, hkv=hkv, dim=32, block=64, density=density,
                           causal=causal, documents=documents)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_random_blocks_match_the_single_process_call(world, layout):
    run_ranks(world, case(10 + world, layout, world=world, batch=2))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_random_blocks(world, layout):
    run_ranks(world, case(20 + world, layout, world=world, causal=True, hq=4, hkv=1))


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_causal_match_the_varlen_call(world):
    run_ranks(world, case(30 + world, "zigzag", world=world, density=None, causal=True, documents=True))


@pytest.mark.parametrize("fmt", ["lists", "bitmask", "bsr"])
def test_patterns_in_other_formats(fmt):
    run_ranks(2, case(80, "zigzag", causal=True, fmt=fmt))


def test_packed_documents_in_the_varlen_layout():
    run_ranks(2, case(90, "contiguous", density=None, causal=True, documents=True, varlen_layout=True))


def test_packed_documents_with_blocks():
    run_ranks(4, case(40, "contiguous", world=4, density=0.5, causal=True, documents=True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_backward_matches_the_single_process_gradients(world, layout):
    run_ranks(world, case(100 + world, layout, world=world, causal=True, hq=4, hkv=2, backward=True))


def test_backward_random_blocks_batched():
    run_ranks(2, case(110, "contiguous", batch=2, backward=True))


def test_backward_packed_documents():
    run_ranks(2, case(120, "zigzag", density=None, causal=True, documents=True, varlen_layout=True, backward=True))
    run_ranks(4, case(121, "contiguous", world=4, density=0.5, causal=True, documents=True, backward=True))


def test_documents_within_chunks_move_nothing():
    """A document per chunk (8 zigzag chunks on 4 ranks): no rank's rows share a document with
    another rank's keys, so nothing travels."""
    stats = run_ranks(4, case(65, "zigzag", world=4, density=None, documents=8))
    for rank, s in stats.items():
        assert s["bytes_received"] == 0, (rank, s)


def test_dense_every_block():
    run_ranks(2, case(50, "contiguous", density=None))


def test_a_local_pattern_moves_less_than_half_of_an_all_gather():
    stats = run_ranks(4, case(60, "contiguous", world=4, density="band", causal=True))
    for rank, s in stats.items():
        assert s["bytes_received"] == (0 if rank == 0 else s["all_gather_bytes"] // 3), (rank, s)
        assert s["bytes_received"] < s["all_gather_bytes"] / 2


def test_bad_shards_are_named():
    q = np.zeros((1, 100, 2, 32), np.float32)
    group = PipeGroup(0, 1, {})
    with pytest.raises(bsattn.BsattnError) as e:
        bd.attention(q, q, q, block_size=64, group=group)
    assert e.value.argument == "block_size"
    with pytest.raises(bsattn.BsattnError) as e:
        bd.attention(q, q, q, block_size=(50, 50), layout="spiral", group=group)
    assert e.value.argument == "layout"
    with pytest.raises(bsattn.BsattnError) as e:
        bd.attention(q[:, :64], q[:, :64], q[:, :64], np.ones((1, 1, 1, 2), bool), block_size=64, group=group)
    assert e.value.argument == "block_mask"
    # Block lists with an entry past the 2 key blocks, then a count past the lists' width: refused
    # by name; validate=False drops such entries.
    x = np.zeros((1, 128, 2, 32), np.float32)
    for counts, indices, what in (([[[1, 1]]], [[[[0, 0], [5, 0]]]], "block indices: 5"),
                                  ([[[3, 1]]], [[[[0, 1], [1, 0]]]], "block counts: 3")):
        lists = bsattn.BlockLists(np.array(counts, np.int32), np.array(indices, np.int32), block_size=(64, 64))
        with pytest.raises(bsattn.BsattnError) as e:
            bd.attention(x, x, x, lists, block_size=64, group=group)
        assert e.value.argument == "block_mask" and what in str(e.value), str(e.value)
    lists = bsattn.BlockLists(np.array([[[1, 1]]], np.int32), np.array([[[[0, 0], [5, 0]]]], np.int32), block_size=(64, 64))
    bd.attention(x, x, x, lists, block_size=64, group=group, validate=False)
    # What a single-process call refuses too: entries not ascending, lists wider than the key
    # blocks, BSR offsets past the indices, a block in both sets.
    refused = [
        (bsattn.BlockLists(np.array([[[2, 1]]], np.int32), np.array([[[[1, 0], [0, 0]]]], np.int32),
                           block_size=(64, 64)), "is not above the one before it"),
        (bsattn.BlockLists(np.array([[[2, 2]]], np.int32), np.array([[[[0, 0], [1, 1]]]], np.int32),
                           block_size=(64, 64)), "is not above the one before it"),
        (bsattn.BlockLists(np.array([[[1, 1]]], np.int32), np.array([[[[0, 0, 0], [1, 0, 0]]]], np.int32),
                           block_size=(64, 64)), "block lists of width 3"),
        (bsattn.BSR(np.array([0, 1, 3], np.int32), np.array([0, 1], np.int32), batch=1, heads=1, block_size=(64, 64)),
         "expected 0 to at most 2"),
        (bsattn.BSR(np.array([0, 2, 3], np.int32), np.array([1, 0, 1], np.int32), batch=1, heads=1,
                    block_size=(64, 64)), "is not above the one before it"),
        (bsattn.BlockLists(np.array([[[1, 1]]], np.int32), np.array([[[[0, 0], [1, 0]]]], np.int32),
                           full_counts=np.array([[[1, 0]]], np.int32), full_indices=np.array([[[[0, 0], [0, 0]]]], np.int32),
                           block_size=(64, 64)), "in both the partial and the full set"),
    ]
    for pattern, what in refused:
        with pytest.raises(bsattn.BsattnError) as e:
            bd.attention(x, x, x, pattern, block_size=64, group=group)
        assert e.value.argument == "block_mask" and what in str(e.value), str(e.value)


def _lists(blocks):
    """Block lists [1, H, nQB] / [1, H, nQB, nKB] of a boolean [1, H, nQB, nKB] mask (-7 past a row's count)."""
    counts = blocks.sum(-1).astype(np.int32)
    indices = np.full(blocks.shape, -7, np.int32)
    for b, h, r in np.ndindex(*blocks.shape[:3]):
        cols = np.flatnonzero(blocks[b, h, r])
        indices[b, h, r, :len(cols)] = cols
    return [counts, indices]


def _bsr(blocks):
    rows = blocks.reshape(-1, blocks.shape[-1])
    indptr = np.concatenate([[0], np.cumsum(rows.sum(-1))]).astype(np.int32)
    return [indptr, np.concatenate([np.flatnonzero(r) for r in rows]).astype(np.int32)]


def test_mutated_patterns_are_refused_as_the_single_process_call():
    """Random values in a one-rank pattern (block lists or BSR, with or without a full set): the
    sharded call refuses, naming block_mask, exactly what bsattn.attention refuses, and otherwise
    gives its O and LSE."""
    rng = np.random.default_rng(7)
    group = PipeGroup(0, 1, {})
    seq, block, heads, dim = 128, 32, 2, 16
    nb = seq // block
    q, k, v = (rng.standard_normal((1, seq, heads, dim), dtype=np.float32) for _ in range(3))
    refused = 0
    for case in range(120):
        blocks = rng.random((1, heads, nb, nb)) < 0.5
        full = blocks & (rng.random(blocks.shape) < 0.5) if case % 2 else None
        partial = blocks & ~full if full is not None else blocks
        bsr = case % 4 >= 2
        arrays = (_bsr if bsr else _lists)(partial) + ((_bsr if bsr else _lists)(full) if full is not None else [])
        target = arrays[rng.integers(len(arrays))]
        if target.size:
            flat = target.reshape(-1)
            at = rng.integers(flat.size)
            flat[at] = rng.choice([flat[at] + 1, flat[at] - 1, -1, 0, nb, nb - 1, 2**31 - 1, rng.integers(-2, 6)])
        size = (block, block)
        if bsr:
            pattern = bsattn.BSR(*arrays[:2], batch=1, heads=heads, block_size=size,
                                 **(dict(full_indptr=arrays[2], full_indices=arrays[3]) if full is not None else {}))
        else:
            pattern = bsattn.BlockLists(*arrays[:2], block_size=size,
                                        **(dict(full_counts=arrays[2], full_indices=arrays[3]) if full is not None else {}))
        single = sharded = None
        try:
            single = bsattn.attention(q, k, v, pattern, return_lse=True)
        except bsattn.BsattnError as e:
            single = e
        try:
            sharded = bd.attention(q, k, v, pattern, block_size=block, group=group, return_lse=True)
        except bsattn.BsattnError as e:
            sharded = e
        what = f"case {case}: single {single if isinstance(single, Exception) else 'accepted'}, sharded {sharded}"
        if isinstance(single, Exception):
            refused += 1
            assert isinstance(sharded, bsattn.BsattnError) and sharded.argument == "block_mask", what
        else:
            assert not isinstance(sharded, Exception), what
            np.testing.assert_allclose(np.asarray(sharded[0]), np.asarray(single[0]), rtol=2e-5, atol=2e-5, err_msg=what)
            np.testing.assert_allclose(np.asarray(sharded[1]), np.asarray(single[1]), rtol=2e-5, atol=2e-5, err_msg=what)
    assert 0 < refused < 120


def gloo_worker(rank, world, port, case, results):
    def body():
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        s = Shard(case, rank, world)
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
        q, k, v = (t(x).requires_grad_(True) for x in s.inputs())
        out, lse = bd.attention(q, k, v, t(s.local_blocks()), block_size=(s.block, s.block), causal=s.causal,
                                layout=s.layout, return_lse=True)
        s.check(out.detach().numpy(), lse.numpy())
        dout = np.random.default_rng(case["inputs"]["seed"] + 1).standard_normal(s.q.shape, dtype=np.float32)
        (out * t(dout[:, s.tokens])).sum().backward()  # autograd through attention_backward
        _, _, want = s.reference_backward(dout)
        for name, g, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            np.testing.assert_allclose(g.numpy(), w[:, s.tokens], rtol=2e-4, atol=5e-5, err_msg=name)
        dist.destroy_process_group()

    reported(rank, results, body)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_process_group(world):
    pytest.importorskip("torch")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spawn_ranks(world, gloo_worker, lambda r: (port, case(70 + world, "zigzag", world=world, causal=True)))
