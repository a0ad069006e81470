// A tiny C interface over bsattn's GPU Plan for the Python benchmark driver (ctypes): the driver
// owns every tensor (torch), so bsattn and its peers read the very same inputs.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"

namespace {
thread_local std::string g_error;

bsattn::TensorView view(void* ptr, bsattn::DType dt, std::initializer_list<std::int64_t> shape) {
  return bsattn::TensorView::contiguous(ptr, dt, shape, bsattn::Device::cuda);
}
}  // namespace

extern "C" {

const char* bsattn_bench_error() { return g_error.c_str(); }

struct BenchPlan {
  bsattn::Plan plan;
  bsattn::Problem problem;
  void* k_summary = nullptr;  // proxy plans (bsattn_bench_set_proxy): [B, ceil(S/bk), Hkv, D]
  void* v_summary = nullptr;
};

}  // extern "C"

namespace {
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Q and K/V of a batched plan: q [B, Sq, Hq, D]; k/v contiguous [B, Skv, Hkv, D], or the page
// caches [num_pages, page_size, Hkv, D] with block_table [B, pages_per_seq] and seq_lens_kv [B]
// (int32) when the plan is paged.
bsattn::Inputs qkv_inputs(const bsattn::Problem& p, void* q, void* k, void* v, void* block_table,
                          void* seq_lens_kv) {
  const std::int64_t B = p.batch, D = p.head_dim;
  bsattn::Inputs in;
  in.q = view(q, p.dtype, {B, p.max_seqlen_q, p.heads_q, D});
  if (p.kv_layout == bsattn::KVLayout::paged) {
    in.k = view(k, p.dtype, {p.num_pages, p.page_size, p.heads_kv, D});
    in.v = view(v, p.dtype, {p.num_pages, p.page_size, p.heads_kv, D});
    in.block_table = view(block_table, bsattn::DType::i32, {B, p.pages_per_seq});
    in.seq_lens_kv = view(seq_lens_kv, bsattn::DType::i32, {B});
  } else {
    in.k = view(k, p.dtype, {B, p.max_seqlen_kv, p.heads_kv, D});
    in.v = view(v, p.dtype, {B, p.max_seqlen_kv, p.heads_kv, D});
  }
  return in;
}

// The partial set of a block_lists plan: cnt [Bs, Hs, nQB] and idx [Bs, Hs, nQB, nKB] int32
// (nQB = ceil(Sq / Bq), nKB = ceil(Skv / Bk)); nothing for all_blocks plans.
void bind_block_lists(const bsattn::Problem& p, bsattn::Inputs& in, void* cnt, void* idx) {
  if (p.format != bsattn::Format::block_lists) return;
  const std::int64_t nqb = ceil_div(p.max_seqlen_q, p.block.q), nkb = ceil_div(p.max_seqlen_kv, p.block.kv);
  in.partial.counts = view(cnt, bsattn::DType::i32, {p.sparsity_batch, p.sparsity_heads, nqb});
  in.partial.indices = view(idx, bsattn::DType::i32, {p.sparsity_batch, p.sparsity_heads, nqb, nkb});
}

// The fields every benchmark plan sets: shape, dtype (O in the same), blocks, the GPU, no
// value checks; one partial set unless the caller says otherwise.
bsattn::Problem gpu_problem(int batch, int hq, int hkv, int head_dim, bsattn::DType dtype, int bq, int bk) {
  bsattn::Problem p;
  p.batch = batch;
  p.heads_q = hq;
  p.heads_kv = hkv;
  p.head_dim = head_dim;
  p.dtype = p.out_dtype = dtype;
  p.block = {bq, bk};
  p.sparsity_batch = 1;
  p.sparsity_heads = 1;
  p.has_partial = true;
  p.has_full = false;
  p.device = bsattn::Device::cuda;
  p.validate = false;
  return p;
}

// A planned handle for `p`, or null with the error recorded (nothing leaks when plan() throws).
void* planned(const bsattn::Problem& p) {
  try {
    auto b = std::make_unique<BenchPlan>();
    b->problem = p;
    b->plan.plan(p);
    return b.release();
  } catch (const std::exception& e) {
    g_error = e.what();
    return nullptr;
  }
}

// O [B, Sq, Hq, D] (out_dtype) and, when lse is not null, LSE [B, Hq, Sq] f32 of a batched plan.
bsattn::Outputs batched_outputs(const bsattn::Problem& p, void* out, void* lse) {
  bsattn::Outputs o;
  o.out = view(out, p.out_dtype, {p.batch, p.max_seqlen_q, p.heads_q, p.head_dim});
  if (lse) o.lse = view(lse, bsattn::DType::f32, {p.batch, p.heads_q, p.max_seqlen_q});
  return o;
}
}  // namespace

extern "C" {

// format: 0 all_blocks (dense + mask), 1 block lists (partial set [1, Hs, nQB, nKB]).
// window_left < 0: none. Returns null on error (bsattn_bench_error says why).
void* bsattn_bench_plan(int batch, int seqlen, int hq, int hkv, int head_dim, int f16, int bq, int bk, int format,
                        int sparsity_heads, int causal, int window_left) {
  bsattn::Problem p = gpu_problem(batch, hq, hkv, head_dim, f16 ? bsattn::DType::f16 : bsattn::DType::bf16, bq, bk);
  p.max_seqlen_q = p.max_seqlen_kv = seqlen;
  p.format = format == 0 ? bsattn::Format::all_blocks : bsattn::Format::block_lists;
  p.sparsity_heads = sparsity_heads;
  p.mask.causal = causal != 0;
  p.mask.window_left = window_left;
  return planned(p);
}

// q/out [B, S, Hq, D], k/v [B, S, Hkv, D], lse [B, Hq, S] (may be null), cnt [1, Hs, nQB] and
// idx [1, Hs, nQB, nKB] int32 (format 1). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_run(void* handle, void* q, void* k, void* v, void* out, void* lse, void* cnt, void* idx,
                     void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    bsattn::Inputs in = qkv_inputs(p, q, k, v, nullptr, nullptr);
    bind_block_lists(p, in, cnt, idx);
    if (p.proxy != bsattn::Proxy::off) {
      const std::int64_t nkb = ceil_div(p.max_seqlen_kv, p.block.kv);
      in.k_summary = view(b->k_summary, p.dtype, {p.batch, nkb, p.heads_kv, p.head_dim});
      in.v_summary = view(b->v_summary, p.dtype, {p.batch, nkb, p.heads_kv, p.head_dim});
    }
    b->plan.run(in, batched_outputs(p, out, lse), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Waits for the stream; returns -1 if the latest run overflowed its route capacity.
int bsattn_bench_check(void* handle, void* stream) {
  try {
    static_cast<BenchPlan*>(handle)->plan.check(stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

void bsattn_bench_free(void* handle) { delete static_cast<BenchPlan*>(handle); }

// Proxy summaries of contiguous k/v [B, S, Hkv, D] into k_summary/v_summary [B, ceil(S/bk),
// Hkv, D] (same dtype), launched on `stream` without validation of values (no host sync).
// Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_summaries(int batch, int seqlen, int hkv, int head_dim, int f16, int bk, void* k, void* v,
                           void* k_summary, void* v_summary, void* stream) {
  try {
    bsattn::Problem p;
    p.batch = batch;
    p.heads_q = p.heads_kv = hkv;
    p.head_dim = head_dim;
    p.max_seqlen_q = 1;
    p.max_seqlen_kv = seqlen;
    p.dtype = p.out_dtype = f16 ? bsattn::DType::f16 : bsattn::DType::bf16;
    p.block = {64, bk};
    p.format = bsattn::Format::all_blocks;
    p.device = bsattn::Device::cuda;
    p.validate = false;
    const std::int64_t nkb = (seqlen + bk - 1) / bk;
    bsattn::Inputs in;
    in.k = view(k, p.dtype, {batch, seqlen, hkv, head_dim});
    in.v = view(v, p.dtype, {batch, seqlen, hkv, head_dim});
    bsattn::build_summaries(p, in, view(k_summary, p.dtype, {batch, nkb, hkv, head_dim}),
                            view(v_summary, p.dtype, {batch, nkb, hkv, head_dim}), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Block selection (SPEC §7) of contiguous q [B, S, Hq, D] against k_summary [B, ceil(S/bk), Hkv, D]
// into bits [B, Hs, ceil(S/bq), ceil(nKB/32)] uint32 (Hs = Hkv when kv_rows, else Hq); policy 0
// top_k (value = k), 1 tau, 2 mass; launched on `stream` without value checks (no host sync).
// Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_select(int batch, int seqlen, int hq, int hkv, int head_dim, int f16, int bq, int bk, int policy,
                        double value, int kv_rows, int causal, void* q, void* k_summary, void* bits, void* stream) {
  try {
    bsattn::Problem p = gpu_problem(batch, hq, hkv, head_dim, f16 ? bsattn::DType::f16 : bsattn::DType::bf16, bq, bk);
    p.max_seqlen_q = p.max_seqlen_kv = seqlen;
    bsattn::SelectOptions o;
    o.policy = static_cast<bsattn::SelectPolicy>(policy);
    o.top_k = static_cast<int>(value);
    o.tau = static_cast<float>(value);
    o.mass = static_cast<float>(value);
    o.causal = causal != 0;
    o.heads = kv_rows ? bsattn::SelectHeads::kv : bsattn::SelectHeads::query;
    const std::int64_t nqb = (seqlen + bq - 1) / bq, nkb = (seqlen + bk - 1) / bk;
    bsattn::Inputs in;
    in.q = view(q, p.dtype, {batch, seqlen, hq, head_dim});
    in.k_summary = view(k_summary, p.dtype, {batch, nkb, hkv, head_dim});
    bsattn::select_blocks(p, in, o,
                          view(bits, bsattn::DType::u32, {batch, kv_rows ? hkv : hq, nqb, (nkb + 31) / 32}), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// merge_states of contiguous outs [N, B, S, H, D] (dtype 0 bf16, 1 f16, 2 f32) and lses
// [N, B, H, S] f32 into out [B, S, H, D] and lse [B, H, S], launched on `stream`.
// Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_merge_states(int parts, int batch, int seqlen, int heads, int head_dim, int dtype, void* outs,
                              void* lses, void* out, void* lse, void* stream) {
  try {
    const bsattn::DType dt = dtype == 2 ? bsattn::DType::f32 : dtype == 1 ? bsattn::DType::f16 : bsattn::DType::bf16;
    bsattn::merge_states(view(outs, dt, {parts, batch, seqlen, heads, head_dim}),
                         view(lses, bsattn::DType::f32, {parts, batch, heads, seqlen}),
                         view(out, dt, {batch, seqlen, heads, head_dim}),
                         view(lse, bsattn::DType::f32, {batch, heads, seqlen}), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Attention of q [B, Sq, Hq, D] against K/V of Skv tokens per sequence (decode, chunked prefill):
// contiguous [B, Skv, Hkv, D], or, when page_size > 0, a page cache [num_pages, page_size, Hkv, D]
// with block_table [B, pages_per_seq] and seq_lens_kv [B]; the built-in causal mask aligned
// bottom-right when `causal`. format 0: every KV block (all_blocks); 1: block lists of KV blocks
// of bk tokens (Q blocks of 128), cnt [Bs, Hs, nQB] / idx [Bs, Hs, nQB, ceil(Skv / bk)] with
// Bs = sparsity_batch (1 or B) and Hs = sparsity_heads (1, Hkv or Hq): e.g. one pattern per
// (sequence, KV head) with Bs = B, Hs = Hkv. bf16. Returns null on error (bsattn_bench_error).
void* bsattn_bench_plan_kv_lists(int batch, int seqlen_q, int seqlen_kv, int hq, int hkv, int head_dim, int causal,
                                 int page_size, int pages_per_seq, int num_pages, int format, int bk,
                                 int sparsity_batch, int sparsity_heads) {
  bsattn::Problem p = gpu_problem(batch, hq, hkv, head_dim, bsattn::DType::bf16, 128, format == 0 ? 128 : bk);
  p.max_seqlen_q = seqlen_q;
  p.max_seqlen_kv = seqlen_kv;
  p.format = format == 0 ? bsattn::Format::all_blocks : bsattn::Format::block_lists;
  p.sparsity_batch = format == 0 ? 1 : sparsity_batch;
  p.sparsity_heads = format == 0 ? 1 : sparsity_heads;
  p.mask.causal = causal != 0;
  if (page_size > 0) {
    p.kv_layout = bsattn::KVLayout::paged;
    p.page_size = page_size;
    p.pages_per_seq = pages_per_seq;
    p.num_pages = num_pages;
  }
  return planned(p);
}

// The run of a bsattn_bench_plan_kv_lists plan: block_table and seq_lens_kv null when contiguous,
// cnt and idx null for format 0, lse [B, Hq, Sq] f32 or null. Returns 0, or -1.
int bsattn_bench_run_kv_lists(void* handle, void* q, void* k, void* v, void* block_table, void* seq_lens_kv,
                              void* cnt, void* idx, void* out, void* lse, void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    bsattn::Inputs in = qkv_inputs(b->problem, q, k, v, block_table, seq_lens_kv);
    bind_block_lists(b->problem, in, cnt, idx);
    b->plan.run(in, batched_outputs(b->problem, out, lse), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Dense attention (every block, built-in causal mask aligned bottom-right when `causal`): the
// format-0 case of bsattn_bench_plan_kv_lists (chunked prefill against a paged cache, decode).
void* bsattn_bench_plan_kv(int batch, int seqlen_q, int seqlen_kv, int hq, int hkv, int head_dim, int causal,
                           int page_size, int pages_per_seq, int num_pages) {
  return bsattn_bench_plan_kv_lists(batch, seqlen_q, seqlen_kv, hq, hkv, head_dim, causal, page_size, pages_per_seq,
                                    num_pages, 0, 128, 1, 1);
}

// The run of a bsattn_bench_plan_kv plan (block_table and seq_lens_kv null when contiguous).
int bsattn_bench_run_kv(void* handle, void* q, void* k, void* v, void* block_table, void* seq_lens_kv, void* out,
                        void* stream) {
  return bsattn_bench_run_kv_lists(handle, q, k, v, block_table, seq_lens_kv, nullptr, nullptr, out, nullptr, stream);
}

// Re-plans a bsattn_bench_plan / bsattn_bench_plan_kv plan with problem.validate set to `validate`
// (value checks on every run). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_set_validate(void* handle, int validate) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    b->problem.validate = validate != 0;
    b->plan.plan(b->problem);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Re-plans a bsattn_bench_plan plan with proxy compensation (SPEC §6): `mode` 0 off, 1 on the
// eligible blocks, 2 on an explicit proxy set (its runs go through bsattn_bench_run_proxy_set);
// its runs then read k_summary / v_summary [B, ceil(S/bk), Hkv, D] (e.g. from
// bsattn_bench_summaries). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_set_proxy(void* handle, int mode, void* k_summary, void* v_summary) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    b->problem.proxy = mode == 2 ? bsattn::Proxy::explicit_set : mode == 1 ? bsattn::Proxy::eligible : bsattn::Proxy::off;
    b->k_summary = k_summary;
    b->v_summary = v_summary;
    b->plan.plan(b->problem);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Host time of Plan::run for a bsattn_bench_plan_kv(_lists) plan (contiguous K/V; cnt and idx its
// block lists, null for all blocks): what one run() costs
// the thread that issues it. Runs are timed in `bursts` bursts of `burst` back-to-back calls on
// the host clock, the stream synchronised (Plan::check) before each burst, outside the clock: a
// burst must be short enough (e.g. 32 runs, a few hundred launches) that the launch queue never
// fills, else the host waits for the GPU and the clock measures GPU time, not the host's cost.
// Writes the median over bursts of the per-call time (microseconds) to host_us[0] and the
// smallest to host_us[1]; returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_host_time_lists(void* handle, void* q, void* k, void* v, void* cnt, void* idx, void* out, void* stream,
                                 int bursts, int burst, double* host_us) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    if (bursts < 1 || burst < 1) throw std::invalid_argument("bursts and burst must be >= 1");
    bsattn::Inputs in = qkv_inputs(b->problem, q, k, v, nullptr, nullptr);
    if (cnt) bind_block_lists(b->problem, in, cnt, idx);
    const bsattn::Outputs o = batched_outputs(b->problem, out, nullptr);
    b->plan.run(in, o, stream);  // warm: first-run work (driver entry points, tensor maps) off the clock
    b->plan.check(stream);
    std::vector<double> per_call(static_cast<std::size_t>(bursts));
    for (double& t : per_call) {
      b->plan.check(stream);  // an empty queue at the start of every burst
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < burst; ++i) b->plan.run(in, o, stream);
      const auto stop = std::chrono::steady_clock::now();
      t = std::chrono::duration<double, std::micro>(stop - start).count() / burst;
    }
    b->plan.check(stream);
    std::sort(per_call.begin(), per_call.end());
    host_us[0] = per_call[per_call.size() / 2];
    host_us[1] = per_call.front();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// bsattn_bench_host_time_lists without block lists (all-blocks plans).
int bsattn_bench_host_time(void* handle, void* q, void* k, void* v, void* out, void* stream, int bursts, int burst,
                           double* host_us) {
  return bsattn_bench_host_time_lists(handle, q, k, v, nullptr, nullptr, out, stream, bursts, burst, host_us);
}

// Re-plans a bsattn_bench_plan plan for the backward too (problem.backward = true, which sizes the
// backward's workspace), bit-identical repeated runs when `deterministic`. Its forward runs as
// before. Returns 0, or -1 (bsattn_bench_error says why, e.g. no GPU backward for this problem).
int bsattn_bench_set_backward(void* handle, int deterministic) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    bsattn::Problem p = b->problem;
    p.backward = true;
    p.deterministic = deterministic != 0;
    b->plan.plan(p);
    b->problem = p;
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Plan::run_backward of a bsattn_bench_plan plan made for the backward (bsattn_bench_set_backward):
// q [B, S, Hq, D], k/v [B, S, Hkv, D], cnt/idx as bsattn_bench_run (format 1; null otherwise), the
// forward's out [B, S, Hq, D] and lse [B, Hq, S] f32, dout like out; writes dq (q's shape) and
// dk/dv (k's shape) in the input dtype, launched on `stream`. Returns 0, or -1.
int bsattn_bench_run_backward(void* handle, void* q, void* k, void* v, void* cnt, void* idx, void* out, void* lse,
                              void* dout, void* dq, void* dk, void* dv, void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    bsattn::Inputs in = qkv_inputs(p, q, k, v, nullptr, nullptr);
    bind_block_lists(p, in, cnt, idx);
    const bsattn::Outputs o = batched_outputs(p, out, lse);
    bsattn::BackwardInputs bi;
    bi.out = o.out;
    bi.lse = o.lse;
    bi.dout = view(dout, p.out_dtype, {p.batch, p.max_seqlen_q, p.heads_q, p.head_dim});
    const bsattn::Inputs grads = qkv_inputs(p, dq, dk, dv, nullptr, nullptr);
    bsattn::Gradients g;
    g.dq = grads.q;
    g.dk = grads.k;
    g.dv = grads.v;
    b->plan.run_backward(in, bi, g, stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Varlen entry points (issue 14.1: the packed-documents row of bench_forward.py, where
// FlashAttention-4 runs its varlen call). Q, K, V and O are packed [total, H, D] with one
// cu_seqlens [B + 1] int32 for queries and keys (Sq = Skv per sequence); every KV block is
// attended (all_blocks) under the built-in mask, e.g. causal within each sequence. The handle is a
// BenchPlan: bsattn_bench_check / bsattn_bench_free / bsattn_bench_error serve it.
// batch sequences of at most max_seqlen tokens, total tokens in all. window_left < 0: none.
// Returns null on error (bsattn_bench_error says why).
void* bsattn_bench_plan_varlen(int batch, int max_seqlen, std::int64_t total, int hq, int hkv, int head_dim, int f16,
                               int bq, int bk, int causal, int window_left) {
  bsattn::Problem p = gpu_problem(batch, hq, hkv, head_dim, f16 ? bsattn::DType::f16 : bsattn::DType::bf16, bq, bk);
  p.max_seqlen_q = p.max_seqlen_kv = max_seqlen;
  p.q_layout = bsattn::QLayout::varlen;
  p.kv_layout = bsattn::KVLayout::contiguous;
  p.total_q = p.total_kv = total;
  p.format = bsattn::Format::all_blocks;
  p.mask.causal = causal != 0;
  p.mask.window_left = window_left;
  return planned(p);
}

// q/out [total, Hq, D], k/v [total, Hkv, D], cu_seqlens [B + 1] int32 (queries and keys), lse
// [Hq, total] f32 (may be null). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_run_varlen(void* handle, void* q, void* k, void* v, void* cu_seqlens, void* out, void* lse,
                            void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    const std::int64_t T = p.total_q, D = p.head_dim;
    bsattn::Inputs in;
    in.q = view(q, p.dtype, {T, p.heads_q, D});
    in.k = view(k, p.dtype, {T, p.heads_kv, D});
    in.v = view(v, p.dtype, {T, p.heads_kv, D});
    in.cu_seqlens_q = view(cu_seqlens, bsattn::DType::i32, {p.batch + 1});
    in.cu_seqlens_k = in.cu_seqlens_q;
    bsattn::Outputs o;
    o.out = view(out, p.out_dtype, {T, p.heads_q, D});
    if (lse) o.lse = view(lse, bsattn::DType::f32, {p.heads_q, T});
    b->plan.run(in, o, stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Document ids (issue 14: the packed documents of the varlen row as one batched sequence with a
// document id per token, which runs the kernels that read token tensors): every KV block of one
// sequence of `seqlen` tokens under the built-in mask, causal and same document.
// Returns null on error (bsattn_bench_error says why).
void* bsattn_bench_plan_documents(int seqlen, int hq, int hkv, int head_dim, int f16, int bq, int bk, int causal) {
  bsattn::Problem p = gpu_problem(1, hq, hkv, head_dim, f16 ? bsattn::DType::f16 : bsattn::DType::bf16, bq, bk);
  p.max_seqlen_q = p.max_seqlen_kv = seqlen;
  p.format = bsattn::Format::all_blocks;
  p.mask.causal = causal != 0;
  p.mask.document_ids = true;
  return planned(p);
}

// q/out [1, S, Hq, D], k/v [1, S, Hkv, D], doc_ids [1, S] int32 (queries and keys), lse [1, Hq, S]
// (may be null). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_run_documents(void* handle, void* q, void* k, void* v, void* doc_ids, void* out, void* lse,
                               void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    bsattn::Inputs in = qkv_inputs(p, q, k, v, nullptr, nullptr);
    in.doc_q = view(doc_ids, bsattn::DType::i32, {1, p.max_seqlen_q});
    in.doc_kv = in.doc_q;
    b->plan.run(in, batched_outputs(p, out, lse), stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

}  // extern "C"

// ---------------------------------------------------------------- proxy diagnostics (issue 11.3)
// Entry points of bench_proxy.py that split the cost of proxy compensation: runs with an explicit
// proxy set (an empty one runs the proxy kernel on the exact work alone), and route preparation
// timed on its own (the kernels Plan::run launches before attention, on bound tensors).
#include <cuda_runtime.h>

#include <stdexcept>
#include <vector>

#include "../../src/formats/bind.hpp"
#include "../../src/gpu/prepare_routes.hpp"

namespace {
// The tensors of a bsattn_bench_plan plan's run (bsattn_bench_run's), with the proxy set
// pcnt [1, Hs, nQB] / pidx [1, Hs, nQB, nKB] when the plan takes an explicit one.
bsattn::Inputs proxy_diag_inputs(const BenchPlan& b, void* q, void* k, void* v, void* cnt, void* idx, void* pcnt,
                                 void* pidx) {
  const bsattn::Problem& p = b.problem;
  const std::int64_t B = p.batch, S = p.max_seqlen_q, D = p.head_dim;
  const std::int64_t nqb = (S + p.block.q - 1) / p.block.q, nkb = (S + p.block.kv - 1) / p.block.kv;
  bsattn::Inputs in;
  in.q = view(q, p.dtype, {B, S, p.heads_q, D});
  in.k = view(k, p.dtype, {B, S, p.heads_kv, D});
  in.v = view(v, p.dtype, {B, S, p.heads_kv, D});
  if (p.format == bsattn::Format::block_lists) {
    in.partial.counts = view(cnt, bsattn::DType::i32, {1, p.sparsity_heads, nqb});
    in.partial.indices = view(idx, bsattn::DType::i32, {1, p.sparsity_heads, nqb, nkb});
    if (p.proxy == bsattn::Proxy::explicit_set) {
      in.proxy.counts = view(pcnt, bsattn::DType::i32, {1, p.sparsity_heads, nqb});
      in.proxy.indices = view(pidx, bsattn::DType::i32, {1, p.sparsity_heads, nqb, nkb});
    }
  }
  if (p.proxy != bsattn::Proxy::off) {
    in.k_summary = view(b.k_summary, p.dtype, {B, nkb, p.heads_kv, D});
    in.v_summary = view(b.v_summary, p.dtype, {B, nkb, p.heads_kv, D});
  }
  return in;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory and events of one timing, released however it ends.
struct TimingResources {
  void* memory = nullptr;
  cudaEvent_t events[3] = {nullptr, nullptr, nullptr};
  ~TimingResources() {
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
    if (memory) cudaFree(memory);
  }
};
}  // namespace

extern "C" {

// bsattn_bench_run with the proxy set pcnt [1, Hs, nQB] / pidx [1, Hs, nQB, nKB] int32 (read only
// by a bsattn_bench_set_proxy plan of mode 2). Returns 0, or -1 (bsattn_bench_error says why).
int bsattn_bench_run_proxy_set(void* handle, void* q, void* k, void* v, void* out, void* cnt, void* idx, void* pcnt,
                               void* pidx, void* stream) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    bsattn::Outputs o;
    o.out = view(out, p.out_dtype, {p.batch, p.max_seqlen_q, p.heads_q, p.head_dim});
    b->plan.run(proxy_diag_inputs(*b, q, k, v, cnt, idx, pcnt, pidx), o, stream);
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

// Route preparation of a bsattn_bench_plan plan on its own: `iters` runs of the preparation
// kernel, then `iters` of the longest-first ordering, each timed by CUDA events on `stream` into
// a workspace of the plan's capacity (allocated here, outside the timing). Writes milliseconds
// per run to *prepare_ms and *order_ms, the route records of the last run (the rows' sum) to
// *records. Returns 0, or -1 (bsattn_bench_error says why, an overflow included).
int bsattn_bench_prepare_time(void* handle, void* q, void* k, void* v, void* out, void* cnt, void* idx, void* pcnt,
                              void* pidx, void* stream, int iters, double* prepare_ms, double* order_ms,
                              long long* records) {
  try {
    auto* b = static_cast<BenchPlan*>(handle);
    const bsattn::Problem& p = b->problem;
    const auto s = static_cast<cudaStream_t>(stream);
    bsattn::Outputs o;
    o.out = view(out, p.out_dtype, {p.batch, p.max_seqlen_q, p.heads_q, p.head_dim});
    bsattn::AttentionParams a = bsattn::formats::bind(p, b->plan.tiles(), b->plan.route_capacity(),
                                                      proxy_diag_inputs(*b, q, k, v, cnt, idx, pcnt, pidx), o);
    const std::int64_t rows = a.route_rows, capacity = a.route.capacity;
    TimingResources r;
    // the route flags (prepare_routes.hpp), counts, proxy counts and order [rows] each, then the
    // records (8-byte aligned)
    const std::size_t ints = (bsattn::gpu::kRouteFlagWords + 3 * static_cast<std::size_t>(rows) + 1) & ~std::size_t(1);
    cuda_ok(cudaMalloc(&r.memory, ints * sizeof(std::int32_t) + rows * capacity * sizeof(bsattn::route::Route)),
            "cudaMalloc");
    auto* overflow = static_cast<std::int32_t*>(r.memory);
    std::int32_t* counts = overflow + bsattn::gpu::kRouteFlagWords;
    std::int32_t* proxy_counts = counts + rows;
    std::int32_t* order = proxy_counts + rows;
    auto* routes = reinterpret_cast<bsattn::route::Route*>(overflow + ints);
    for (cudaEvent_t& e : r.events) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
    cuda_ok(cudaMemsetAsync(overflow, 0, bsattn::gpu::kRouteFlagWords * sizeof(std::int32_t), s), "cudaMemsetAsync");
    const bool proxy = a.route.proxy_mode != 0;
    const auto prepare = [&]() {
      cuda_ok(bsattn::gpu::prepare_routes(a, routes, counts, overflow, s, proxy ? proxy_counts : nullptr),
              "prepare_routes");
    };
    prepare();  // warm-up
    cuda_ok(cudaEventRecord(r.events[0], s), "cudaEventRecord");
    for (int i = 0; i < iters; ++i) prepare();
    cuda_ok(cudaEventRecord(r.events[1], s), "cudaEventRecord");
    for (int i = 0; i < iters; ++i)
      cuda_ok(bsattn::gpu::order_rows(counts, static_cast<int>(rows), bsattn::gpu::row_order_groups(a.route), order, s),
              "order_rows");
    cuda_ok(cudaEventRecord(r.events[2], s), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(r.events[2]), "cudaEventSynchronize");
    float t_prepare = 0.0f, t_order = 0.0f;
    cuda_ok(cudaEventElapsedTime(&t_prepare, r.events[0], r.events[1]), "cudaEventElapsedTime");
    cuda_ok(cudaEventElapsedTime(&t_order, r.events[1], r.events[2]), "cudaEventElapsedTime");
    std::int32_t flag[2] = {0, 0};
    std::vector<std::int32_t> host(static_cast<std::size_t>(rows));
    cuda_ok(cudaMemcpy(flag, overflow, sizeof flag, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cuda_ok(cudaMemcpy(host.data(), counts, host.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (flag[0] != 0) throw std::runtime_error("route row " + std::to_string(flag[0] - 1) + " overflowed");
    *prepare_ms = t_prepare / iters;
    *order_ms = t_order / iters;
    *records = 0;
    for (std::int32_t c : host) *records += c;
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

}  // extern "C"
