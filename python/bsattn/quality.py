"""``python -m bsattn.quality``: how far block selection alone, and selection + proxy compensation,
land from dense attention on structured (video-like) inputs, and what each stage costs.

For each density the command selects blocks with `bsattn.select_blocks` (summaries from
`bsattn.build_summaries`), runs `bsattn.attention` on the selected set without and with
``proxy=``, and reports the relative L2 error of each against dense attention computed in float64
from the same (rounded) inputs, with the time of every stage and of bsattn's dense attention.
It prints a table and writes a PNG plot (matplotlib) of error against density. docs/PYTHON.md,
"Quality you can see", shows an example and the measured figures.

The inputs (`video_tokens`) stand in for a video model's Q/K/V: tokens on a (t, h, w) grid in raster
order, so a block of 64 tokens is a strip of a few rows of one frame (or, with ``tile``, in tile
order, so that a block is a compact t x h x w box). Per head,
``Q = P + c C + n N_q`` and ``K = P + c C + n N_k`` (each term unit variance per entry):
* P, a smooth positional field (random Fourier features of a Gaussian kernel of ``correlation``
  tokens) shared by Q and K, so a token attends its neighbours;
* C, a content field of rank ``rank`` that is smooth over (h, w) and drifts ``motion`` tokens
  along w per frame, shared by Q and K, so a token also attends the same object in other frames;
* N, independent noise.
V is a smooth field of its own plus noise. ``logit_scale`` multiplies Q (sharper or flatter
attention). No package on PyPI ships captured Q/K/V activations of a video model (the tools that
extract them need the model's weights from a hub), so there is no "real data" option.
"""

import argparse
import dataclasses
import math
import statistics
import time

import numpy as np

from . import _api, _select
from .sparsity import Bitmask, _block_size

GOAL_DENSITY = 0.175  # issue 11: with proxy, at most half the error of selection alone here
GOAL_RATIO = 0.5
DEFAULT_DENSITIES = (0.05, 0.1, 0.175, 0.25, 0.35, 0.5)


@dataclasses.dataclass(frozen=True)
class VideoTokens:
    """Shape and structure of the generated Q/K/V (see the module docstring)."""

    grid: tuple = (10, 16, 32)  # (t, h, w) tokens; S = t * h * w
    heads: int = 4
    head_dim: int = 64
    correlation: float = 4.0  # tokens: length scale of the positional field
    content_correlation: float = 8.0  # tokens: length scale of the content field over (h, w)
    rank: int = 8
    content: float = 0.7  # weight of the content field against the positional one
    motion: float = 0.5  # tokens per frame the content drifts along w
    noise: float = 0.3
    value_noise: float = 0.5
    logit_scale: float = 1.0  # multiplies Q: larger is sharper attention
    tile: tuple = None  # (a, b, c): token order by tiles of a x b x c (t, h, w); None: raster order
    seed: int = 0

    @property
    def seqlen(self):
        return math.prod(self.grid)


def _grid_coordinates(grid):
    """float64 [S, 3]: (t, h, w) of each token in raster order (w fastest)."""
    t, h, w = np.meshgrid(*(np.arange(n, dtype=np.float64) for n in grid), indexing="ij")
    return np.stack([t.ravel(), h.ravel(), w.ravel()], axis=1)


def _smooth_field(rng, coords, length, features):
    """[S, features], unit variance per entry, correlation exp(-|x - y|^2 / (2 length^2)) between
    tokens x and y: random Fourier features of a Gaussian kernel."""
    frequencies = rng.standard_normal((coords.shape[1], features)) / length
    phases = rng.uniform(0.0, 2.0 * np.pi, features)
    return np.sqrt(2.0) * np.cos(coords @ frequencies + phases)


def compact_tile(grid, tokens):
    """The (a, b, c) with a * b * c = tokens, each dividing its grid dimension, of least spread
    (sum of squared sides): e.g. 2 x 4 x 8 for blocks of 64 on a 10 x 16 x 32 grid."""
    shapes = [(a, b, tokens // (a * b)) for a in range(1, tokens + 1) for b in range(1, tokens + 1)
              if tokens % (a * b) == 0]
    fitting = [shape for shape in shapes if all(n % side == 0 for n, side in zip(grid, shape))]
    if not fitting:
        raise ValueError(f"no tile of {tokens} tokens divides the grid {tuple(grid)}")
    return min(fitting, key=lambda shape: sum(side * side for side in shape))


def _tile_order(grid, tile):
    """Token indices in tile order: tile after tile (raster order of tiles), raster inside one."""
    (t, h, w), (a, b, c) = grid, tile
    index = np.arange(t * h * w).reshape(t // a, a, h // b, b, w // c, c)
    return index.transpose(0, 2, 4, 1, 3, 5).ravel()


def video_tokens(spec):
    """(q, k, v): float64 [1, S, H, D] video-like tokens (module docstring)."""
    rng = np.random.default_rng(spec.seed)
    coords = _grid_coordinates(spec.grid)
    # The content sits at (h, w - motion * t): the same object in every frame, drifting along w.
    content_coords = np.stack([coords[:, 1], coords[:, 2] - spec.motion * coords[:, 0]], axis=1)
    s, d = spec.seqlen, spec.head_dim
    q, k, v = (np.empty((1, s, spec.heads, d)) for _ in range(3))
    for h in range(spec.heads):
        position = _smooth_field(rng, coords, spec.correlation, d)
        coefficients = _smooth_field(rng, content_coords, spec.content_correlation, spec.rank)
        content = coefficients @ rng.standard_normal((spec.rank, d)) / np.sqrt(spec.rank)
        shared = position + spec.content * content
        q[0, :, h] = spec.logit_scale * (shared + spec.noise * rng.standard_normal((s, d)))
        k[0, :, h] = shared + spec.noise * rng.standard_normal((s, d))
        v[0, :, h] = _smooth_field(rng, coords, spec.correlation, d) + spec.value_noise * rng.standard_normal((s, d))
    if spec.tile is None:
        return q, k, v
    # The same tokens in another order: only the layout of the blocks changes.
    order = _tile_order(spec.grid, spec.tile)
    return q[:, order], k[:, order], v[:, order]


# ---- Arrays of either framework: NumPy (CPU) or PyTorch (CUDA) -----------------------------

def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _float64(x):
    return x.double() if _is_torch(x) else np.asarray(x, np.float64)


def _row_max(x):
    return x.amax(dim=1, keepdim=True) if _is_torch(x) else x.max(axis=1, keepdims=True)


def _exp(x):
    return x.exp() if _is_torch(x) else np.exp(x)


def _concatenate(parts, axis):
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def _group_sums(x, size):
    """Sums of consecutive groups of `size` columns of a 2-D array, a shorter last group included."""
    n = x.shape[-1]
    full = n - n % size
    parts = [x[:, :full].reshape(x.shape[0], full // size, size).sum(-1)]
    if full < n:
        parts.append(x[:, full:].sum(-1)[:, None])
    return _concatenate(parts, 1)


@dataclasses.dataclass
class Reference:
    """Dense attention in float64, and where its softmax mass lies, per (head, Q block, KV block).

    ``block_mass``: the softmax mass of the KV block's tokens, summed over the Q block's queries
    (each query's row sums to 1). ``proxy_mass``: the same for the proxy term that stands in for
    the block, ``n_j exp(scale <q, mean K_j>)`` in the same normalisation. By Jensen's inequality
    it is at most the block's mass, the more so the more the logits vary inside the block:
    ``logit_spread`` is their standard deviation over a KV block, averaged over (query, block).
    """

    out: object  # float64 [1, S, H, D]
    block_mass: object  # float64 [H, nQB, nKB]
    proxy_mass: object
    logit_spread: float


def dense_reference(q, k, v, block_size, scale=None, rows_per_chunk=1024):
    """`Reference` of float64 q, k, v [1, S, H, D] (NumPy, or PyTorch on any device), by chunks of
    whole Q blocks so that the score matrix never has to fit at once."""
    s, heads, d = q.shape[1:]
    bq, bk = block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows_per_chunk = max(1, rows_per_chunk // bq) * bq
    new = q.new_zeros if _is_torch(q) else np.zeros
    out = new(q.shape)
    q_blocks, kv_blocks = -(-s // bq), -(-s // bk)
    block_mass, proxy_mass = new((heads, q_blocks, kv_blocks)), new((heads, q_blocks, kv_blocks))
    counts = _group_sums(new((1, s)) + 1.0, bk)  # [1, nKB]: in-range tokens per KV block
    spread = 0.0
    for h in range(heads):
        keys, values = k[0, :, h], v[0, :, h]
        key_means = _group_sums(keys.T, bk).T / counts.T  # [nKB, D]
        for start in range(0, s, rows_per_chunk):
            queries = q[0, start:start + rows_per_chunk, h]
            scores = scale * (queries @ keys.T)
            top = _row_max(scores)
            weights = _exp(scores - top)
            total = weights.sum(1)[:, None]
            out[0, start:start + rows_per_chunk, h] = (weights @ values) / total
            rows = slice(start // bq, start // bq + -(-queries.shape[0] // bq))
            block_mass[h, rows] = _group_sums((_group_sums(weights, bk) / total).T, bq).T
            proxy = counts * _exp(scale * (queries @ key_means.T) - top) / total
            proxy_mass[h, rows] = _group_sums(proxy.T, bq).T
            mean = _group_sums(scores, bk) / counts
            variance = _group_sums(scores * scores, bk) / counts - mean * mean
            spread += float((variance.clip(0) ** 0.5).sum())
    return Reference(out, block_mass, proxy_mass, spread / (heads * s * kv_blocks))


def relative_error(out, reference):
    """||out - reference||_2 / ||reference||_2 over every element, in float64."""
    difference = _float64(out) - reference
    return float(((difference ** 2).sum() / (reference ** 2).sum()) ** 0.5)


def _bits_on_host(mask):
    bits = mask.sets["partial"]["bits"]
    return np.asarray(bits.cpu() if _is_torch(bits) else bits).view(np.uint32)


def selected_blocks(mask, kv_blocks):
    """bool [B, Hs, nQB, nKB]: the blocks a `select_blocks` bitmask selects."""
    words = _bits_on_host(mask)
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :kv_blocks].astype(bool)


def density_of(mask, kv_blocks):
    """Fraction of (row, KV block) pairs a bitmask selects."""
    return float(selected_blocks(mask, kv_blocks).mean())


# ---- The measurement ---------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    """One density of the sweep: the selection, both errors and the stage times (seconds)."""

    target_density: float
    parameter: float  # top_k, tau or mass that gave the selection
    density: float  # measured: selected pairs / all pairs
    dropped: float  # softmax mass of the unselected blocks, mean over queries
    recovered: float  # the proxy terms' mass / the unselected blocks' mass
    error_selection: float
    error_proxy: float
    time_selection: float
    time_attention: float
    time_attention_proxy: float
    mask: Bitmask = dataclasses.field(repr=False, default=None)

    @property
    def ratio(self):
        return self.error_proxy / self.error_selection if self.error_selection > 0 else float("nan")


@dataclasses.dataclass
class Report:
    spec: VideoTokens
    dtype: str
    device: str
    block_size: tuple
    policy: str
    rows: list
    time_summaries: float
    time_dense: float
    error_dense: float  # bsattn's dense attention against the float64 reference: the dtype's floor
    logit_spread: float  # `Reference.logit_spread`

    def goal_row(self):
        """The row whose measured density is closest to the goal's density."""
        return min(self.rows, key=lambda row: abs(row.density - GOAL_DENSITY))


def _median_time(call, repeats, synchronize):
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibrate(select, target, low, high, increasing, steps=24):
    """(parameter, mask) of the policy parameter in [low, high] whose density is closest to
    target, by bisection: density grows with the parameter when `increasing` (mass), falls (tau)."""
    best = None
    for _ in range(steps):
        middle = 0.5 * (low + high)
        mask, density = select(middle)
        if best is None or abs(density - target) < abs(best[2] - target):
            best = (middle, mask, density)
        if (density < target) == increasing:
            low = middle
        else:
            high = middle
    return best[0], best[1]


class _Engine:
    """Where the tensors live and how to wait for them: NumPy on the CPU engine, PyTorch on CUDA."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("quality: --device cuda needs PyTorch with a visible GPU")
            from ._bsattn import built_with_cuda

            if not built_with_cuda:
                raise SystemExit("quality: this bsattn build has no GPU engine (BSATTN_ENABLE_CUDA=ON pip install .)")
            self.torch = torch
            self.synchronize = torch.cuda.synchronize
        else:
            self.synchronize = lambda: None

    def tensor(self, x64):
        """The float64 NumPy array in the run's dtype and device."""
        if self.device == "cuda":
            torch = self.torch
            return torch.from_numpy(x64).to(device="cuda", dtype=getattr(torch, _TORCH_DTYPES[self.dtype]))
        if self.dtype == "bf16":
            import ml_dtypes

            return x64.astype(ml_dtypes.bfloat16)
        return x64.astype(np.float16 if self.dtype == "f16" else np.float32)


_TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _to_numpy(x):
    return x.cpu().numpy() if _is_torch(x) else x


def measure(spec=VideoTokens(), *, densities=DEFAULT_DENSITIES, block_size=(64, 64), policy="top_k", sinks=0,
            local=0, dtype="f32", device="cpu", repeats=3):
    """Runs the sweep and returns a `Report` (one `Row` per density, in the given order)."""
    engine = _Engine(device, dtype)
    block_size = bq, bk = _block_size(block_size)
    q, k, v = (engine.tensor(x) for x in video_tokens(spec))
    reference = dense_reference(*(_float64(x) for x in (q, k, v)), block_size)  # on the inputs' device
    block_mass, proxy_mass = (_to_numpy(x) for x in (reference.block_mass, reference.proxy_mass))
    time_stage = lambda call: _median_time(call, repeats, engine.synchronize)  # noqa: E731

    summaries = _api.build_summaries(k, v, bk)
    time_summaries = time_stage(lambda: _api.build_summaries(k, v, bk, validate=False))
    dense = _api.attention(q, k, v)
    error_dense = relative_error(dense, reference.out)
    time_dense = time_stage(lambda: _api.attention(q, k, v, validate=False))
    kv_blocks = summaries.k_summary.shape[1]

    def select(validate=True, **policy_value):
        return _select.select_blocks(q, summaries.k_summary, block_size, sinks=sinks, local=local,
                                     validate=validate, **policy_value)

    def select_measured(value):
        mask = select(**{policy: value})
        return mask, density_of(mask, kv_blocks)

    rows = []
    for target in densities:
        if policy == "top_k":
            parameter = max(1, round(target * kv_blocks))
            mask = select(top_k=parameter)
        elif policy == "tau":
            parameter, mask = _calibrate(select_measured, target, -4.0, 8.0, increasing=False)
        else:
            parameter, mask = _calibrate(select_measured, target, 1e-6, 1.0, increasing=True)
        time_selection = time_stage(lambda: select(validate=False, **{policy: parameter}))
        out = _api.attention(q, k, v, mask)
        time_attention = time_stage(lambda: _api.attention(q, k, v, mask, validate=False))
        out_proxy = _api.attention(q, k, v, mask, proxy=summaries)
        time_attention_proxy = time_stage(lambda: _api.attention(q, k, v, mask, proxy=summaries, validate=False))
        unselected = ~selected_blocks(mask, kv_blocks)[0]
        dropped = float(block_mass[unselected].sum())
        recovered = float(proxy_mass[unselected].sum()) / dropped if dropped else 1.0
        rows.append(Row(target, parameter, 1.0 - float(unselected.mean()), dropped / (spec.heads * spec.seqlen), recovered,
                        relative_error(out, reference.out), relative_error(out_proxy, reference.out),
                        time_selection, time_attention, time_attention_proxy, mask))
    return Report(spec, dtype, device, (bq, bk), policy, rows, time_summaries, time_dense, error_dense,
                  reference.logit_spread)


# ---- Output: table, plot, command line ---------------------------------------------------

def _ms(seconds):
    return f"{seconds * 1e3:.1f}"


def format_report(report):
    """The report as text: a header, one line per density, the dense line and the goal's line."""
    spec = report.spec
    t, h, w = spec.grid
    bq, bk = report.block_size
    order = "raster order" if spec.tile is None else "tiles of {} x {} x {}".format(*spec.tile)
    lines = [
        f"bsattn quality: video-like tokens, grid (t, h, w) = ({t}, {h}, {w}) in {order}, S = {spec.seqlen}, "
        f"H = {spec.heads}, D = {spec.head_dim}, logit scale {spec.logit_scale:g}, {report.dtype}, "
        f"blocks {bq} x {bk}, policy {report.policy}, device {report.device}",
        "error: relative L2 against dense attention in float64 on the same inputs; times: median, ms",
        f"summaries (once for every density): {_ms(report.time_summaries)} ms; "
        f"dense attention: {_ms(report.time_dense)} ms, error {report.error_dense:.2e}",
        f"logit spread inside a KV block (std, mean over query x block): {report.logit_spread:.2f}",
        "",
        f"{'density':>7} {report.policy:>7} {'dropped':>7} {'recov':>6} {'err select':>10} {'err +proxy':>10} "
        f"{'ratio':>6} {'select':>7} {'attend':>7} {'+proxy':>7} {'vs dense':>8}",
    ]
    for row in report.rows:
        parameter = f"{row.parameter:d}" if isinstance(row.parameter, int) else f"{row.parameter:.4g}"
        pipeline = report.time_summaries + row.time_selection + row.time_attention_proxy
        lines.append(f"{row.density:7.3f} {parameter:>7} {row.dropped:7.4f} {row.recovered:6.3f} "
                     f"{row.error_selection:10.2e} {row.error_proxy:10.2e} {row.ratio:6.3f} "
                     f"{_ms(row.time_selection):>7} {_ms(row.time_attention):>7} {_ms(row.time_attention_proxy):>7} "
                     f"{report.time_dense / pipeline:7.2f}x")
    lines += [
        "dropped: softmax mass of the unselected blocks (mean over queries); recov: the share of it the proxy terms "
        "give back",
        "ratio = err +proxy / err select; vs dense = dense time / (summaries + select + attend with proxy)",
    ]
    goal = report.goal_row()
    verdict = "met" if goal.ratio <= GOAL_RATIO else "NOT met"
    lines.append(f"goal (issue 11): err +proxy <= {GOAL_RATIO} x err select at density {GOAL_DENSITY}: "
                 f"{goal.ratio:.3f} at density {goal.density:.3f}, {verdict}")
    return "\n".join(lines)


def plot_report(report, path):
    """Writes a PNG of error against density (left) and the stage times (right). Returns False,
    writing nothing, when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    density = [row.density for row in report.rows]
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    errors, times = figure.subplots(1, 2)
    errors.semilogy(density, [row.error_selection for row in report.rows], "o-", label="selection")
    errors.semilogy(density, [row.error_proxy for row in report.rows], "s-", label="selection + proxy")
    errors.axhline(report.error_dense, color="gray", linestyle=":", label=f"dense ({report.dtype} floor)")
    errors.axvline(GOAL_DENSITY, color="gray", linestyle="--", linewidth=0.8)
    goal = report.goal_row()
    errors.plot([goal.density], [GOAL_RATIO * goal.error_selection], "k_", markersize=14,
                label=f"goal: {GOAL_RATIO} x selection")
    errors.set(xlabel="density (selected blocks / all)", ylabel="relative L2 error vs dense",
               title="error against dense attention")
    errors.legend()
    errors.grid(True, which="both", alpha=0.3)
    for label, key in (("selection", "time_selection"), ("attention", "time_attention"),
                       ("attention + proxy", "time_attention_proxy")):
        times.plot(density, [getattr(row, key) * 1e3 for row in report.rows], "o-", label=label)
    times.axhline(report.time_summaries * 1e3, color="tab:purple", linestyle="-.", label="summaries")
    times.axhline(report.time_dense * 1e3, color="gray", linestyle=":", label="dense attention")
    times.set(xlabel="density (selected blocks / all)", ylabel="ms (median)", title="time per stage")
    times.legend()
    times.grid(True, alpha=0.3)
    spec = report.spec
    order = "raster" if spec.tile is None else "tiles {}x{}x{}".format(*spec.tile)
    figure.suptitle(f"bsattn quality: S = {spec.seqlen} ({order}), H = {spec.heads}, D = {spec.head_dim}, "
                    f"logit scale {spec.logit_scale:g}, {report.dtype}, blocks {report.block_size[0]} x "
                    f"{report.block_size[1]}, {report.policy}, {report.device}")
    figure.savefig(path, dpi=110)
    return True


def _floats(text):
    return tuple(float(x) for x in text.split(","))


def parse_args(argv=None):
    defaults = VideoTokens()
    parser = argparse.ArgumentParser(
        prog="python -m bsattn.quality",
        description="Relative L2 error against dense attention versus density, for block selection alone and "
                    "selection + proxy compensation, on video-like Q/K/V; and the time of each stage.")
    parser.add_argument("--grid", type=int, nargs=3, default=defaults.grid, metavar=("T", "H", "W"),
                        help="token grid (frames, height, width); S = T * H * W (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--block", type=int, nargs="+", default=[64], metavar="B",
                        help="block size: Bq [Bk] (default: 64)")
    parser.add_argument("--densities", type=_floats, default=DEFAULT_DENSITIES,
                        help="comma-separated target densities (default: %(default)s)")
    parser.add_argument("--policy", choices=("top_k", "tau", "mass"), default="top_k",
                        help="selection policy; tau and mass are bisected to each target density")
    parser.add_argument("--sinks", type=int, default=0, help="first blocks always selected")
    parser.add_argument("--local", type=int, default=0, help="neighbour blocks on each side always selected")
    parser.add_argument("--dtype", choices=("f32", "f16", "bf16"), default=None,
                        help="input dtype (default: f32 on the CPU, bf16 on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per stage (median)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for name in ("correlation", "content_correlation", "content", "motion", "noise", "value_noise"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name),
                            help="input structure, see the module docstring (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=defaults.rank, help="rank of the content field")
    parser.add_argument("--logit-scale", type=float, default=defaults.logit_scale,
                        help="multiplies Q: sharper (> 1) or flatter (< 1) attention (default: %(default)s)")
    parser.add_argument("--order", choices=("raster", "tiles"), default="raster",
                        help="token order: raster (w fastest), or tiles of Bk tokens, each a compact t x h x w box "
                             "(see --tile), so that a KV block is one tile")
    parser.add_argument("--tile", type=int, nargs=3, metavar=("A", "B", "C"),
                        help="tile shape for --order tiles (default: the most compact one of Bk tokens)")
    parser.add_argument("--plot", default="bsattn-quality.png", help="PNG path (default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if len(args.block) > 2:
        parser.error("--block takes Bq and optionally Bk")
    args.block = (args.block[0], args.block[-1])
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "f32"
    return args


def main(argv=None):
    args = parse_args(argv)
    tile = None
    if args.order == "tiles":
        try:
            tile = tuple(args.tile) if args.tile else compact_tile(args.grid, args.block[1])
        except ValueError as error:
            raise SystemExit(f"quality: {error}; pick another --grid or --block") from None
        if any(n % side for n, side in zip(args.grid, tile)) or math.prod(tile) != args.block[1]:
            raise SystemExit(f"quality: the tile {tile} must divide the grid {tuple(args.grid)} and hold "
                             f"Bk = {args.block[1]} tokens")
    spec = VideoTokens(grid=tuple(args.grid), heads=args.heads, head_dim=args.head_dim, correlation=args.correlation,
                       content_correlation=args.content_correlation, rank=args.rank, content=args.content,
                       motion=args.motion, noise=args.noise, value_noise=args.value_noise,
                       logit_scale=args.logit_scale, tile=tile, seed=args.seed)
    report = measure(spec, densities=args.densities, block_size=args.block, policy=args.policy, sinks=args.sinks,
                     local=args.local, dtype=args.dtype, device=args.device, repeats=args.repeats)
    print(format_report(report))
    if not args.no_plot:
        if plot_report(report, args.plot):
            print(f"plot: {args.plot}")
        else:
            print("plot: matplotlib is not installed; `pip install matplotlib` and run again for the PNG")
    return report


if __name__ == "__main__":
    main()
