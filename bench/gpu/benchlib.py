"""What the GPU bench drivers share: loading libbsattn_bench.so (bench_shim.cpp) with the ctypes
signatures of its entry points, pointer / stream / error helpers, CUDA-event timing, a paged copy
of K/V, and the header line of a result table.

    import benchlib
    LIB = benchlib.load(path)              # every entry point the build has, argtypes set
    benchlib.ok(LIB, LIB.bsattn_bench_run(h, benchlib.ptr(q), ...))
    ms = benchlib.timed(call, iters)       # median CUDA-event ms of `call` after warm-up

Imports torch only (no GPU work at import time), so drivers that run without a GPU can still
import it.
"""
import ctypes
import os
import statistics
import time

import torch

_P, _I, _I64, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double

# name -> (restype, argtypes) of the shim's entry points (bench_shim.cpp says what each takes).
SIGNATURES = {
    "bsattn_bench_error": (ctypes.c_char_p, []),
    "bsattn_bench_plan": (_P, [_I] * 12),
    "bsattn_bench_run": (_I, [_P] * 9),
    "bsattn_bench_check": (_I, [_P, _P]),
    "bsattn_bench_free": (None, [_P]),
    "bsattn_bench_summaries": (_I, [_I] * 6 + [_P] * 5),
    "bsattn_bench_select": (_I, [_I] * 9 + [_D, _I, _I] + [_P] * 4),
    "bsattn_bench_merge_states": (_I, [_I] * 6 + [_P] * 5),
    "bsattn_bench_plan_kv": (_P, [_I] * 10),
    "bsattn_bench_run_kv": (_I, [_P] * 8),
    "bsattn_bench_plan_kv_lists": (_P, [_I] * 14),
    "bsattn_bench_run_kv_lists": (_I, [_P] * 11),
    "bsattn_bench_set_validate": (_I, [_P, _I]),
    "bsattn_bench_set_proxy": (_I, [_P, _I, _P, _P]),
    "bsattn_bench_host_time": (_I, [_P] * 6 + [_I, _I, ctypes.POINTER(_D)]),
    "bsattn_bench_host_time_lists": (_I, [_P] * 8 + [_I, _I, ctypes.POINTER(_D)]),
    "bsattn_bench_set_backward": (_I, [_P, _I]),
    "bsattn_bench_run_backward": (_I, [_P] * 13),
    "bsattn_bench_plan_varlen": (_P, [_I, _I, _I64] + [_I] * 8),
    "bsattn_bench_run_varlen": (_I, [_P] * 8),
    # the shim's proxy diagnostics block
    "bsattn_bench_run_proxy_set": (_I, [_P] * 10),
    "bsattn_bench_prepare_time": (_I, [_P] * 10 + [_I, ctypes.POINTER(_D), ctypes.POINTER(_D),
                                                   ctypes.POINTER(ctypes.c_longlong)]),
}


def load(path, need=()):
    """ctypes.CDLL of libbsattn_bench.so with the signature of every entry point it has (an older
    build may lack some); raises if one named in `need` is missing (rebuild the library)."""
    lib = ctypes.CDLL(os.path.abspath(path))
    for name, (res, args) in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
    missing = [n for n in need if not hasattr(lib, n)]
    if missing:
        raise RuntimeError(f"{path} lacks {', '.join(missing)}: rebuild the bench target (bench/gpu/bench_shim.cpp)")
    return lib


def ptr(t):
    """A tensor's data pointer for the shim (None for None)."""
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def stream():
    """The current torch stream as the shim's `stream` argument."""
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def ok(lib, rc):
    """Raises RuntimeError with the shim's message when an entry point returned non-zero."""
    if rc != 0:
        raise RuntimeError(lib.bsattn_bench_error().decode())


def handle(lib, h):
    """Raises RuntimeError with the shim's message when a plan entry point returned null."""
    if not h:
        raise RuntimeError(lib.bsattn_bench_error().decode())
    return h


class Plan:
    """A shim plan handle that frees itself (bsattn_bench_free) when dropped."""

    def __init__(self, lib, h):
        self.lib, self.h = lib, handle(lib, h)

    def check(self):
        ok(self.lib, self.lib.bsattn_bench_check(self.h, stream()))

    def __del__(self):
        if getattr(self, "h", None):
            self.lib.bsattn_bench_free(self.h)
            self.h = None


_SLEEP = {}


def queue_ahead_available():
    """Whether timed(..., queue_us > 0) can fill the GPU queue ahead (torch.cuda._sleep exists)."""
    return hasattr(torch.cuda, "_sleep")


def _cycles_per_us():
    """GPU clock cycles per microsecond, measured once with torch.cuda._sleep (None if absent)."""
    if "c" not in _SLEEP:
        c = None
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(1000)  # load the kernel
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(2_000_000)
            b.record()
            b.synchronize()
            c = 2_000_000 / max(a.elapsed_time(b) * 1e3, 1.0)
        _SLEEP["c"] = c
    return _SLEEP["c"]


def timed(fns, iters, warmup=3, queue_us=0.0):
    """Median ms of `fns` (a callable, or a list of callables taken in turn, e.g. one per rotated
    copy of the inputs) over `iters` CUDA-event timings after `warmup` calls, a sync after each.

    queue_us > 0: before each timed call the stream sleeps that long on the GPU
    (torch.cuda._sleep), so the call's launches are all queued before its start event fires and
    the events bracket GPU execution only (kernels and the gaps between them on the device), not
    the host's launch cost: the GPU time of calls of a few microseconds. Choose it longer than
    the host needs to issue one call (Python peers: ~100 us)."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    cycles = int(queue_us * _cycles_per_us()) if queue_us > 0 and _cycles_per_us() else 0
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cycles:
            torch.cuda._sleep(cycles)
        a.record()
        fns[i % len(fns)]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timed_back_to_back(fn, iters, host_us=300.0):
    """Median ms per call of `iters` calls run back to back on the GPU: all are queued behind a
    GPU sleep long enough for the host to issue them (host_us per call), with an event between
    consecutive calls, so each timing is one call's GPU time with the GPU never idle in between:
    neither the host's launch path (a Python peer's ~100-250 us) nor the clocks' recovery during
    a sync enters it. Falls back to no sleep where torch.cuda._sleep is missing."""
    cycles = int(iters * host_us * _cycles_per_us()) if queue_ahead_available() and _cycles_per_us() else 0
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    if cycles:
        torch.cuda._sleep(cycles)
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def timed_settled(fn, iters, settle_s=1.0, warmup=3):
    """timed_back_to_back after `warmup` calls and `settle_s` seconds of back-to-back calls, so
    that the GPU runs at the clocks its power limit settles to: under the H100's 700 W limit the
    clocks are high for the first tens of milliseconds after an idle phase (a peer's checks, a
    compile) and then fall, more for kernels that draw more power per clock (bench/RESULTS.md,
    2026-12-06 16:30-17:00)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    settle([fn], settle_s)
    return timed_back_to_back(fn, iters)


def settle(fns, seconds):
    """Runs the callables in turn, 8 calls each and a sync per turn, for `seconds` (timed_settled)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for fn in fns:
            for _ in range(8):
                fn()
        torch.cuda.synchronize()


def timed_rotated(fns, iters, rounds, settle_s=1.0):
    """Per callable, the median ms over `rounds` rounds of `iters` back-to-back calls
    (timed_back_to_back), and the median of its per-round ratio to the first callable. All are
    settled together for `settle_s` seconds first, and take turns within a round in an order
    rotated from round to round, so that the GPU's drift between rounds enters every callable
    alike and a ratio compares calls timed moments apart."""
    settle(fns, settle_s)
    per_round = [[0.0] * len(fns) for _ in range(rounds)]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            per_round[r][i] = timed_back_to_back(fns[i], iters)
    ms = [statistics.median(pr[i] for pr in per_round) for i in range(len(fns))]
    return ms, [statistics.median(pr[i] / pr[0] for pr in per_round) for i in range(len(fns))]


def timed_by(timing, fn, iters, settle_s=1.0):
    """The benchmarks' --timing: "queued" (timed_settled) or "synced" (timed: an event pair and a
    sync around each call, the method until 2026-12-06)."""
    return timed(fn, iters) if timing == "synced" else timed_settled(fn, iters, settle_s)


_NVSMI = {}


def _nvsmi_fields():
    """The query fields nvidia-smi takes here (drivers before 535 name the cap reasons
    clocks_throttle_reasons), or None."""
    import subprocess
    if "fields" not in _NVSMI:
        _NVSMI["fields"] = None
        for reason in ("clocks_event_reasons", "clocks_throttle_reasons"):
            fields = f"clocks.sm,power.draw,{reason}.sw_power_cap,temperature.gpu"
            r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                _NVSMI["fields"] = fields
                break
    return _NVSMI["fields"]


def power_profile(fn, ms_per_call, seconds=2.0, sample_ms=20):
    """The GPU's SM clock (MHz), board power (W), share of samples capped by the power limit and
    temperature (C), medians of nvidia-smi samples over the second half of `seconds` of
    back-to-back calls of fn (the first half lets clocks and power settle). None where nvidia-smi
    is missing or refuses a field. Back-to-back timings of long kernels run at the clocks the
    power limit leaves, so two kernels of equal work can time apart by their energy per FLOP."""
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi") or not _nvsmi_fields():
        return None
    calls = max(4, int(seconds * 1e3 / max(ms_per_call, 1e-3)))
    fn()
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    cmd = ["nvidia-smi", "-i", str(dev), f"--query-gpu={_nvsmi_fields()}", "--format=csv,noheader,nounits",
           f"-lms={sample_ms}"]
    mon = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    span = time.monotonic() - t0
    mon.terminate()
    out, _ = mon.communicate()
    rows = [r.split(", ") for r in out.strip().splitlines()]
    rows = [r for r in rows if len(r) == 4]
    rows = rows[len(rows) // 2:]  # the settled half
    if not rows:
        return None

    def med(i):  # "[N/A]" samples left out
        vals = []
        for r in rows:
            try:
                vals.append(float(r[i]))
            except ValueError:
                pass
        return statistics.median(vals) if vals else float("nan")
    capped = sum(1 for r in rows if r[2].strip() == "Active") / len(rows)
    return dict(mhz=med(0), watts=med(1), capped=capped, temp=med(3), samples=len(rows), span_s=span,
                ms=span * 1e3 / calls)


def rel_err(a, b):
    """Relative L2 error of a against b (float32)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def page(k, v, page_size, gen, seq_lens=None):
    """k, v [B, S, Hkv, D] scattered over the shuffled pages of caches [num_pages, page_size, Hkv,
    D] (7 spare pages). Pages no sequence uses hold NaN, which no correct kernel reads; the tail
    of a sequence's last page past S holds zeros (a kernel may load it whole and mask it).
    Returns (k_cache, v_cache, block_table [B, pages_per_seq] int32, seq_lens [B] int32,
    pages_per_seq, num_pages); seq_lens defaults to S for every sequence."""
    B, S, hkv, D = k.shape
    per_seq = (S + page_size - 1) // page_size
    num_pages = B * per_seq + 7
    order = torch.randperm(num_pages, generator=gen)[: B * per_seq].view(B, per_seq).to(torch.int32)
    caches = []
    for t in (k, v):
        cache = torch.full((num_pages, page_size, hkv, D), float("nan"), dtype=t.dtype, device=t.device)
        padded = torch.zeros((B, per_seq * page_size, hkv, D), dtype=t.dtype, device=t.device)
        padded[:, :S] = t
        cache[order.flatten().long().to(t.device)] = padded.view(B * per_seq, page_size, hkv, D)
        del padded
        caches.append(cache)
    lens = torch.full((B,), S, dtype=torch.int32, device=k.device) if seq_lens is None else seq_lens
    return caches[0], caches[1], order.to(k.device), lens, per_seq, num_pages


def header(extra=""):
    """One line naming the GPU, torch and the UTC time (the first line of a result file)."""
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}" + (f"; {extra}" if extra else ""))


def write(path, lines):
    """Writes the lines of a result table to `path` (nothing when path is empty)."""
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
