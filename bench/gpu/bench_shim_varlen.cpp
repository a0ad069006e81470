// Varlen entry points of the benchmark shim (issue 14.1: the packed-documents row of
// bench_forward.py, where FlashAttention-4 runs its varlen call). Q, K, V and O are packed
// [total, H, D] with one cu_seqlens [B + 1] int32 for queries and keys (Sq = Skv per sequence);
// every KV block is attended (all_blocks) under the built-in mask, e.g. causal within each
// sequence. Same conventions as bench_shim.cpp: the driver owns every tensor (torch), plans are
// made with validate = false (no host sync), errors are returned, not thrown.
#include <cstdint>
#include <exception>
#include <string>

#include "bsattn/bsattn.hpp"

namespace {
thread_local std::string g_varlen_error;

struct VarlenPlan {
  bsattn::Plan plan;
  bsattn::Problem problem;
};

bsattn::TensorView view(void* ptr, bsattn::DType dt, std::initializer_list<std::int64_t> shape) {
  return bsattn::TensorView::contiguous(ptr, dt, shape, bsattn::Device::cuda);
}
}  // namespace

extern "C" {

const char* bsattn_bench_varlen_error() { return g_varlen_error.c_str(); }

// batch sequences of at most max_seqlen tokens, total tokens in all. window_left < 0: none.
// Returns null on error (bsattn_bench_varlen_error says why).
void* bsattn_bench_plan_varlen(int batch, int max_seqlen, std::int64_t total, int hq, int hkv, int head_dim, int f16,
                               int bq, int bk, int causal, int window_left) {
  try {
    auto* b = new VarlenPlan;
    bsattn::Problem& p = b->problem;
    p.batch = batch;
    p.heads_q = hq;
    p.heads_kv = hkv;
    p.head_dim = head_dim;
    p.max_seqlen_q = p.max_seqlen_kv = max_seqlen;
    p.q_layout = bsattn::QLayout::varlen;
    p.kv_layout = bsattn::KVLayout::contiguous;
    p.total_q = p.total_kv = total;
    p.dtype = p.out_dtype = f16 ? bsattn::DType::f16 : bsattn::DType::bf16;
    p.block = {bq, bk};
    p.format = bsattn::Format::all_blocks;
    p.sparsity_heads = 1;
    p.has_partial = true;
    p.has_full = false;
    p.mask.causal = causal != 0;
    p.mask.window_left = window_left;
    p.device = bsattn::Device::cuda;
    p.validate = false;
    b->plan.plan(p);
    return b;
  } catch (const std::exception& e) {
    g_varlen_error = e.what();
    return nullptr;
  }
}

// q/out [total, Hq, D], k/v [total, Hkv, D], cu_seqlens [B + 1] int32 (queries and keys), lse
// [Hq, total] f32 (may be null). Returns 0, or -1 (bsattn_bench_varlen_error says why).
int bsattn_bench_run_varlen(void* handle, void* q, void* k, void* v, void* cu_seqlens, void* out, void* lse,
                            void* stream) {
  try {
    auto* b = static_cast<VarlenPlan*>(handle);
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
    g_varlen_error = e.what();
    return -1;
  }
}

// Waits for the stream; returns -1 if the latest run overflowed its route capacity.
int bsattn_bench_check_varlen(void* handle, void* stream) {
  try {
    static_cast<VarlenPlan*>(handle)->plan.check(stream);
    return 0;
  } catch (const std::exception& e) {
    g_varlen_error = e.what();
    return -1;
  }
}

void bsattn_bench_free_varlen(void* handle) { delete static_cast<VarlenPlan*>(handle); }

}  // extern "C"
