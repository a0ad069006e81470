"""Gradients on the GPU (issue 13.3): torch.autograd through bsattn.attention on CUDA tensors
against FlexAttention's backward of the same BlockMask (bfloat16), torch.compile of a loss and its
backward, forward and backward captured in a CUDA graph and replayed on new values, and a few
training steps of a small model through bsattn.from_block_mask that follow FlexAttention's.
Skipped without CUDA or without a bsattn built with BSATTN_ENABLE_CUDA=ON."""

import pytest

torch = pytest.importorskip("torch")

import bsattn  # noqa: E402
from flex_cases import CASES, bsattn_on_flex_layout, flex_reference, make_case  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not bsattn.built_with_cuda, reason="bsattn built without CUDA (BSATTN_ENABLE_CUDA=ON)"),
]

# Relative L2 error allowed between two bfloat16 computations of the same gradient (each rounds
# P, dS and the stored O differently).
REL = 2e-2


@pytest.fixture(scope="module")
def compiled_flex():
    return torch.compile(flex_reference)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def output_and_grads(fn, q, k, v, dout):
    """fn's output and dq, dk, dv for the upstream gradient dout (fresh leaves of the inputs)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", CASES)
def test_autograd_matches_flex_attention(name, head_dim, compiled_flex):
    q, k, v, block_mask, mask = make_case(name, "cuda", torch.bfloat16, seqlen=1000, head_dim=head_dim)
    dout = torch.randn_like(q)
    out, grads = output_and_grads(lambda q, k, v: bsattn_on_flex_layout(q, k, v, block_mask, mask), q, k, v, dout)
    ref_out, ref_grads = output_and_grads(lambda q, k, v: compiled_flex(q, k, v, block_mask), q, k, v, dout)
    assert rel_err(out, ref_out) < REL
    for got, want, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.isfinite(got).all(), what
        assert rel_err(got, want) < REL, what


def test_compiled_loss_and_backward_match_eager():
    """torch.compile(fullgraph=True) of a loss of O and the LSE on CUDA tensors, backward included,
    gives eager's gradients (up to the order of dQ's fp32 atomic adds, then rounded to bfloat16)."""
    q, k, v, block_mask, mask = make_case("causal", "cuda", torch.bfloat16, seqlen=700, head_dim=128)
    sparsity = bsattn.from_block_mask(block_mask)
    dout = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device="cuda")
    dlse = torch.randn(q.shape[0], q.shape[1], q.shape[2], device="cuda")

    def loss(q, k, v):
        out, lse = bsattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sparsity, mask=mask,
                                    return_lse=True)
        return (out.float() * dout).sum() + (lse * dlse).sum()

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    for e, c in zip(eager, compiled):
        assert rel_err(c, e) < 1e-2


def test_cuda_graph_replays_forward_and_backward_on_new_values():
    """Forward and backward captured in one CUDA graph (plans made in the warm-up), replayed after
    new values were copied into the same inputs: the gradients are eager's on those values (up to
    the order of dQ's atomic adds)."""
    q, k, v, block_mask, mask = make_case("random_blocks", "cuda", torch.bfloat16, seqlen=640, head_dim=128)
    sparsity = bsattn.from_block_mask(block_mask)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():  # validate=False: value checks copy metadata to the host, which capture forbids
        out = bsattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sparsity, mask=mask,
                               validate=False)
        out.transpose(1, 2).backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in (q, k, v):
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.grad.clone() for t in (q, k, v)]
    _, eager = output_and_grads(
        lambda a, b, c: bsattn.attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), sparsity,
                                         mask=mask).transpose(1, 2), q, k, v, dout)
    for r, e, what in zip(replayed, eager, ("dq", "dk", "dv")):
        assert rel_err(r, e) < 1e-2, what


def test_training_steps_follow_flex_attention(compiled_flex):
    """A small attention layer (projections to q, k, v, attention over a BlockMask, output
    projection) trained for a few SGD steps twice from the same weights, once through
    bsattn.from_block_mask and once through FlexAttention (float32 weights, bfloat16 compute): the
    losses and the weight updates stay together within bfloat16 rounding."""
    batch, seqlen, heads, head_dim, width = 2, 512, 4, 64, 256
    _, _, _, block_mask, mask = make_case("document", "cuda", torch.bfloat16, batch=batch, seqlen=seqlen,
                                          heads=heads, head_dim=head_dim)
    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(batch, seqlen, width, device="cuda", generator=generator, dtype=torch.bfloat16)
    target = torch.randn(batch, seqlen, width, device="cuda", generator=generator, dtype=torch.bfloat16)
    init = [torch.randn(width, heads * head_dim, device="cuda", generator=generator) / width ** 0.5 for _ in range(3)]
    init.append(torch.randn(heads * head_dim, width, device="cuda", generator=generator) / (heads * head_dim) ** 0.5)

    def train(attend, steps=4, lr=0.5):
        weights = [w.clone().requires_grad_(True) for w in init]
        losses = []
        for _ in range(steps):
            wq, wk, wv, wo = (w.to(torch.bfloat16) for w in weights)
            q, k, v = ((x @ w).view(batch, seqlen, heads, head_dim).transpose(1, 2) for w in (wq, wk, wv))
            o = attend(q, k, v).transpose(1, 2).reshape(batch, seqlen, heads * head_dim)
            loss = ((o @ wo).float() - target.float()).pow(2).mean()
            grads = torch.autograd.grad(loss, weights)
            with torch.no_grad():
                for w, g in zip(weights, grads):
                    w -= lr * g
            losses.append(loss.item())
        return losses, weights

    ours, ours_weights = train(lambda q, k, v: bsattn_on_flex_layout(q, k, v, block_mask, mask))
    flex, flex_weights = train(lambda q, k, v: compiled_flex(q, k, v, block_mask))
    assert ours[-1] < ours[0]  # it trains
    for a, b in zip(ours, flex):
        assert abs(a - b) <= 2e-2 * abs(b), (ours, flex)
    for a, b, w in zip(ours_weights, flex_weights, init):
        assert rel_err(a.detach() - w, b.detach() - w) < 5e-2
