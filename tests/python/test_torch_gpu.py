"""The PyTorch integration on the GPU: agreement with FlexAttention on the same BlockMask in
bfloat16, torch.compile, CUDA-graph capture with metadata changed between replays, the current
stream. Skipped without CUDA or without a bsattn built with BSATTN_ENABLE_CUDA=ON."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bsattn  # noqa: E402
from conftest import assert_close, random_blocks, reference, reference_varlen  # noqa: E402
from flex_cases import CASES, bsattn_on_flex_layout, flex_reference, make_case  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not bsattn.built_with_cuda, reason="bsattn built without CUDA (BSATTN_ENABLE_CUDA=ON)"),
]

BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def compiled_flex():
    return torch.compile(flex_reference)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", CASES)
def test_matches_flex_attention(name, head_dim, compiled_flex):
    q, k, v, block_mask, mask = make_case(name, "cuda", torch.bfloat16, seqlen=1000, head_dim=head_dim)
    expected = compiled_flex(q, k, v, block_mask)
    torch.testing.assert_close(bsattn_on_flex_layout(q, k, v, block_mask, mask), expected, **BF16)


def test_matches_flex_attention_with_small_blocks(compiled_flex):
    q, k, v, block_mask, mask = make_case("random_blocks", "cuda", torch.bfloat16, seqlen=700, block_size=(64, 64))
    torch.testing.assert_close(bsattn_on_flex_layout(q, k, v, block_mask, mask),
                               compiled_flex(q, k, v, block_mask), **BF16)


def test_varlen_packed_against_reference():
    rng = np.random.default_rng(3)
    block_size = (128, 128)
    seqlens_q, seqlens_k = [300, 0, 513], [200, 64, 700]
    cu_q = np.cumsum([0] + seqlens_q).astype(np.int32)
    cu_k = np.cumsum([0] + seqlens_k).astype(np.int32)
    dense = [random_blocks(rng, (2, -(-sq // 128), -(-sk // 128))) for sq, sk in zip(seqlens_q, seqlens_k)]
    counts, indices, cu_m, cu_n = reference.varlen_block_lists(dense)
    q, k, v = (torch.randn(int(n), h, 128, dtype=torch.bfloat16, device="cuda")
               for n, h in ((cu_q[-1], 4), (cu_k[-1], 2), (cu_k[-1], 2)))
    cuda = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    fields = (cuda(counts), cuda(indices), None, None, cuda(cu_m), cuda(cu_n))
    sparsity = bsattn.from_flash_attention(fields, block_size)
    out = bsattn.attention(q, k, v, sparsity, cu_seqlens_q=cuda(cu_q), cu_seqlens_k=cuda(cu_k),
                           max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), mask=bsattn.Mask(causal=True))
    expected, _ = reference_varlen(*(t.float().cpu().numpy() for t in (q, k, v)), cu_q, cu_k, dense, block_size,
                                   reference.MaskSpec(causal=True))
    assert_close(out.float().cpu().numpy(), expected, "bfloat16")


def test_torch_compile_matches_eager():
    q, k, v, block_mask, mask = make_case("sliding_window", "cuda", torch.bfloat16, seqlen=1000)

    def run(q, k, v):
        return bsattn_on_flex_layout(q, k, v, block_mask, mask, return_lse=True)

    out, lse = torch.compile(run, fullgraph=True)(q, k, v)
    expected_out, expected_lse = run(q, k, v)
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)


def test_compile_reduce_overhead_cuda_graphs():
    """torch.compile's CUDA graphs (mode="reduce-overhead") on the trusted path."""
    q, k, v, block_mask, mask = make_case("causal", "cuda", torch.bfloat16, seqlen=1000)
    sparsity = bsattn.from_block_mask(block_mask)

    def run(q, k, v):
        return bsattn.attention(q, k, v, sparsity, mask=mask, validate=False)

    compiled = torch.compile(run, mode="reduce-overhead", fullgraph=True)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        torch.testing.assert_close(compiled(q, k, v).clone(), run(q, k, v), atol=0, rtol=0)


def _capture(fn):
    """Warm up on a side stream (plans are made there), then capture one call of fn."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


@pytest.mark.parametrize("through", ["custom_op", "plan"])
def test_cuda_graph_replay_follows_metadata_values(through):
    """Metadata values may change between replays (SPEC §8); addresses and shapes may not."""
    q, k, v = (torch.randn(2, 1000, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    shape = (2, 4, 8, 8)
    dense = torch.rand(shape, device="cuda") < 0.5
    lists = bsattn.from_dense_block_mask(dense, 128)
    counts, indices = lists.sets["partial"]["counts"], lists.sets["partial"]["indices"]
    mask = bsattn.Mask(causal=True)
    if through == "plan":
        plan = bsattn.Plan(q, k, v, lists, mask=mask, validate=False)
        graph, out = _capture(lambda: plan(q, k, v))
    else:
        graph, out = _capture(lambda: bsattn.attention(q, k, v, lists, mask=mask, validate=False))
    for _ in range(3):
        dense = torch.rand(shape, device="cuda") < 0.5
        fresh = bsattn.from_dense_block_mask(dense, 128)
        counts.copy_(fresh.sets["partial"]["counts"])
        indices.copy_(fresh.sets["partial"]["indices"])
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(out, bsattn.attention(q, k, v, fresh, mask=mask), atol=0, rtol=0)


def test_runs_on_the_current_stream():
    q, k, v = (torch.randn(1, 4000, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    expected = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q2 = q * 1  # produced on `stream`: a run on another stream could read it too early
        out = bsattn.attention(q2, k, v, mask=bsattn.Mask(causal=True))
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_bad_index_on_the_device_raises():
    q, k, v = (torch.randn(1, 256, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    counts = torch.ones(1, 1, 2, dtype=torch.int32, device="cuda")
    indices = torch.full((1, 1, 2, 1), 7, dtype=torch.int32, device="cuda")
    with pytest.raises(bsattn.BsattnError, match=r"partial\.indices"):
        bsattn.attention(q, k, v, bsattn.BlockLists(counts, indices, block_size=128))
