// Random problems for the GPU tests: every input format, batched and varlen (empty sequences
// included), GQA, tails, built-in masks, empty rows. Each case keeps host copies of all tensors
// (for the CPU engine, the reference) and mirrors them on the device.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bsattn/bsattn.hpp"
#include "bsattn/cpu/numeric.hpp"

namespace bsattn_gpu_test {

using namespace bsattn;

#define CUDA_OK(x)                                                                 \
  do {                                                                             \
    const cudaError_t e_ = (x);                                                    \
    ASSERT_EQ(e_, cudaSuccess) << #x << ": " << cudaGetErrorString(e_);            \
  } while (0)

// An SM90 device is present (the kernels are built for sm_90a only).
inline bool have_sm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9;
}

#define REQUIRE_SM90() \
  if (!have_sm90()) GTEST_SKIP() << "no SM90 GPU on this machine"

// A tensor with a host copy and (after upload) a device copy of the same bytes.
struct Buffer {
  std::vector<unsigned char> host;
  void* device = nullptr;
  DType dtype = DType::i32;
  std::vector<std::int64_t> shape;
  ~Buffer() {
    if (device) cudaFree(device);
  }
  std::size_t bytes() const { return host.size(); }
  void upload() {
    if (!device && !host.empty()) cudaMalloc(&device, host.size());
    if (device) cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  void download() {
    if (device) cudaMemcpy(host.data(), device, host.size(), cudaMemcpyDeviceToHost);
  }
  TensorView view(Device where) const {
    TensorView t;
    t.data = where == Device::cpu ? const_cast<unsigned char*>(host.data()) : device;
    if (host.empty() && where == Device::cpu) t.data = nullptr;
    t.dtype = dtype;
    t.device = where;
    t.rank = static_cast<int>(shape.size());
    std::int64_t s = 1;
    for (int i = t.rank - 1; i >= 0; --i) {
      t.shape[i] = shape[i];
      t.stride[i] = s;
      s *= shape[i];
    }
    return t;
  }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(host.data());
  }
};

struct Sets {
  BlockSet host, device;
};

class Case {
 public:
  Problem problem;
  std::vector<int> seqlen_q, seqlen_kv;
  std::string name;

  // rows[(b * Hs + hs) * max_q_blocks + qb]: selected partial / full KV blocks (b = 0 when Bs = 1).
  std::vector<std::vector<int>> partial_rows, full_rows;

  std::vector<std::unique_ptr<Buffer>> buffers;
  Buffer *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *lse = nullptr;
  Buffer *cu_q = nullptr, *cu_k = nullptr;
  Buffer *doc_q = nullptr, *doc_kv = nullptr, *kv_valid = nullptr;
  Buffer *k_summary = nullptr, *v_summary = nullptr;  // proxy cases (built by the CPU engine)
  Inputs in_host, in_device;
  Outputs out_host, out_device;

  Buffer* add(DType dt, std::vector<std::int64_t> shape) {
    auto b = std::make_unique<Buffer>();
    b->dtype = dt;
    b->shape = std::move(shape);
    std::int64_t n = 1;
    for (auto s : b->shape) n *= s;
    b->host.assign(static_cast<std::size_t>(n) * element_size(dt), 0);
    buffers.push_back(std::move(b));
    return buffers.back().get();
  }
  template <class T>
  Buffer* add_values(DType dt, const std::vector<T>& values, std::vector<std::int64_t> shape) {
    Buffer* b = add(dt, std::move(shape));
    b->host.resize(values.size() * sizeof(T));
    if (!values.empty()) std::memcpy(b->host.data(), values.data(), b->host.size());
    return b;
  }

  bool varlen() const { return problem.q_layout == QLayout::varlen; }
  int batch() const { return problem.batch; }
  int q_blocks(int b) const { return (seqlen_q[b] + problem.block.q - 1) / problem.block.q; }
  int kv_blocks(int b) const { return (seqlen_kv[b] + problem.block.kv - 1) / problem.block.kv; }
  int max_q_blocks() const { return (problem.max_seqlen_q + problem.block.q - 1) / problem.block.q; }
  int max_kv_blocks() const { return (problem.max_seqlen_kv + problem.block.kv - 1) / problem.block.kv; }
  int pattern_batch() const { return varlen() ? batch() : problem.sparsity_batch; }
  int hs() const { return problem.format == Format::all_blocks ? 1 : problem.sparsity_heads; }
  std::size_t row(int b, int h, int qb) const {
    return (static_cast<std::size_t>(pattern_batch() == 1 ? 0 : b) * hs() + h) * max_q_blocks() + qb;
  }

  void poison_outputs() {
    std::fill(out->host.begin(), out->host.end(), 0xff);
    if (lse) std::fill(lse->host.begin(), lse->host.end(), 0xff);
    cudaMemset(out->device, 0xff, out->bytes());
    if (lse) cudaMemset(lse->device, 0xff, lse->bytes());
  }

  void bind_views() {
    auto both = [&](TensorView Inputs::*f, Buffer* b) {
      if (!b) return;
      in_host.*f = b->view(Device::cpu);
      in_device.*f = b->view(Device::cuda);
    };
    both(&Inputs::q, q);
    both(&Inputs::k, k);
    both(&Inputs::v, v);
    both(&Inputs::cu_seqlens_q, cu_q);
    both(&Inputs::cu_seqlens_k, cu_k);
    both(&Inputs::doc_q, doc_q);
    both(&Inputs::doc_kv, doc_kv);
    both(&Inputs::kv_valid, kv_valid);
    both(&Inputs::k_summary, k_summary);
    both(&Inputs::v_summary, v_summary);
    out_host.out = out->view(Device::cpu);
    out_device.out = out->view(Device::cuda);
    if (lse) {
      out_host.lse = lse->view(Device::cpu);
      out_device.lse = lse->view(Device::cuda);
    }
  }
};

struct CaseSpec {
  Format format = Format::block_lists;
  bool varlen = false;
  DType dtype = DType::bf16;
  int head_dim = 128;
  int bq = 128, bk = 128;
  int hq = 4, hkv = 2;
  int sparsity_heads = 0;  // 0: drawn
  double density = 0.5;
  bool full_set = true;
  int mask = -1;  // -1 drawn; 0 none, 1 causal, 2 causal+window, 3 window+sink, 4 documents, 5 kv-valid bits
  int max_seqlen = 300;
  int max_seqlen_q = 0;  // query tokens (0: max_seqlen), e.g. a few for decode cases
  bool exact_seqlen_q = false;  // batched: every sequence has max_seqlen_q queries (else drawn)
  int batch = 0;  // 0: drawn
  bool out_f32 = false;  // f32 output (the kernel stages it in two column halves)
  // Proxy compensation (SPEC §6): summaries built by the CPU engine; an explicit set names each
  // unselected block with probability explicit_fraction, and every block of an empty row.
  Proxy proxy = Proxy::off;
  double explicit_fraction = 0.6;
  std::uint64_t seed = 1;
};


inline std::uint16_t to_bits(float x, DType dt) {
  return dt == DType::bf16 ? cpu::float_to_bf16(x) : cpu::float_to_half(x);
}

// Builds a random case (host and device tensors; outputs poisoned).
inline std::unique_ptr<Case> make_case(const CaseSpec& spec) {
  auto c = std::make_unique<Case>();
  std::mt19937_64 rng(spec.seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  Problem& p = c->problem;
  const bool varlen = spec.varlen || spec.format == Format::varlen_block_lists;
  p.batch = spec.batch > 0 ? spec.batch : varlen ? uni(2, 4) : uni(1, 2);
  p.heads_q = spec.hq;
  p.heads_kv = spec.hkv;
  p.head_dim = spec.head_dim;
  p.dtype = spec.dtype;
  p.out_dtype = spec.out_f32 ? DType::f32 : spec.dtype;
  p.block = {spec.bq, spec.bk};
  p.format = spec.format;
  p.device = Device::cuda;
  p.validate = false;
  const int hs_choices[3] = {1, spec.hkv, spec.hq};
  p.sparsity_heads = spec.sparsity_heads > 0 ? spec.sparsity_heads : hs_choices[uni(0, 2)];
  // Varlen rows of [Bs, Hs, nQB] block lists are per sequence (pattern_batch() is B).
  p.sparsity_batch = (varlen && spec.format == Format::block_lists) || (!varlen && p.batch > 1 && chance(0.5)) ? p.batch : 1;
  p.has_partial = true;
  p.has_full = spec.format != Format::all_blocks && spec.full_set;
  p.q_layout = varlen ? QLayout::varlen : QLayout::batched;
  p.proxy = spec.proxy;

  // Sequence lengths: tails everywhere; varlen has empty sequences.
  const int max_q = spec.max_seqlen_q > 0 ? spec.max_seqlen_q : spec.max_seqlen;
  for (int b = 0; b < p.batch; ++b) {
    if (varlen) {
      const int sq = (b == 1) ? 0 : uni(1, max_q);
      const int skv = (b == 2) ? 0 : uni(1, spec.max_seqlen);
      c->seqlen_q.push_back(sq);
      c->seqlen_kv.push_back(skv);
    } else {
      c->seqlen_q.push_back(0);
      c->seqlen_kv.push_back(0);
    }
  }
  if (!varlen) {
    const int sq = spec.exact_seqlen_q ? max_q : uni(std::max(1, max_q / 2), max_q);
    const int skv = uni(spec.max_seqlen / 2, spec.max_seqlen);
    for (int b = 0; b < p.batch; ++b) c->seqlen_q[b] = sq, c->seqlen_kv[b] = skv;
  }
  p.max_seqlen_q = std::max(1, *std::max_element(c->seqlen_q.begin(), c->seqlen_q.end()));
  p.max_seqlen_kv = std::max(1, *std::max_element(c->seqlen_kv.begin(), c->seqlen_kv.end()));
  std::int64_t total_q = 0, total_kv = 0;
  std::vector<std::int32_t> cu_q{0}, cu_k{0};
  for (int b = 0; b < p.batch; ++b) {
    total_q += c->seqlen_q[b];
    total_kv += c->seqlen_kv[b];
    cu_q.push_back(static_cast<std::int32_t>(total_q));
    cu_k.push_back(static_cast<std::int32_t>(total_kv));
  }
  p.total_q = total_q;
  p.total_kv = total_kv;

  // Mask.
  const int mask = spec.mask >= 0 ? spec.mask : uni(0, 5);
  if (mask == 1 || mask == 2) p.mask.causal = true;
  if (mask == 1 && chance(0.3)) p.mask.alignment = Alignment::top_left;
  if (mask == 2) p.mask.window_left = uni(10, 150);
  if (mask == 3) {
    p.mask.window_left = uni(10, 100);
    p.mask.window_right = uni(0, 50);
    p.mask.sink_tokens = uni(0, 40);
    p.mask.causal = chance(0.5);  // the sinks' interval under the causal limit (fwd/mask.cuh)
  }
  if (mask == 4) p.mask.document_ids = true;
  if (mask == 5) p.mask.kv_valid_bits = true;

  // Q, K, V.
  const int D = p.head_dim;
  auto fill = [&](Buffer* b) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto* x = b->as<std::uint16_t>();
    const std::size_t n = b->bytes() / 2;
    for (std::size_t i = 0; i < n; ++i) x[i] = to_bits(nd(rng), p.dtype);
  };
  if (varlen) {
    c->q = c->add(p.dtype, {std::max<std::int64_t>(total_q, 1), p.heads_q, D});
    c->k = c->add(p.dtype, {std::max<std::int64_t>(total_kv, 1), p.heads_kv, D});
    c->v = c->add(p.dtype, {std::max<std::int64_t>(total_kv, 1), p.heads_kv, D});
    c->q->shape[0] = std::max<std::int64_t>(total_q, 1);
    c->out = c->add(p.out_dtype, {std::max<std::int64_t>(total_q, 1), p.heads_q, D});
    c->lse = c->add(DType::f32, {p.heads_q, std::max<std::int64_t>(total_q, 1)});
    c->cu_q = c->add_values(DType::i32, cu_q, {p.batch + 1});
    c->cu_k = c->add_values(DType::i32, cu_k, {p.batch + 1});
  } else {
    c->q = c->add(p.dtype, {p.batch, p.max_seqlen_q, p.heads_q, D});
    c->k = c->add(p.dtype, {p.batch, p.max_seqlen_kv, p.heads_kv, D});
    c->v = c->add(p.dtype, {p.batch, p.max_seqlen_kv, p.heads_kv, D});
    c->out = c->add(p.out_dtype, {p.batch, p.max_seqlen_q, p.heads_q, D});
    c->lse = c->add(DType::f32, {p.batch, p.heads_q, p.max_seqlen_q});
  }
  fill(c->q);
  fill(c->k);
  fill(c->v);
  if (p.mask.document_ids) {
    const std::int64_t nq = varlen ? std::max<std::int64_t>(total_q, 1) : std::int64_t(p.batch) * p.max_seqlen_q;
    const std::int64_t nk = varlen ? std::max<std::int64_t>(total_kv, 1) : std::int64_t(p.batch) * p.max_seqlen_kv;
    std::vector<std::int32_t> dq(nq), dk(nk);
    // Documents: runs of random length, ids increasing along the sequence (same for q and kv
    // positions scaled to their lengths).
    for (auto* d : {&dq, &dk}) {
      int id = 0;
      for (std::size_t i = 0; i < d->size(); ++i) {
        if (chance(0.02)) ++id;
        (*d)[i] = id;
      }
    }
    if (varlen) {
      c->doc_q = c->add_values(DType::i32, dq, {nq});
      c->doc_kv = c->add_values(DType::i32, dk, {nk});
    } else {
      c->doc_q = c->add_values(DType::i32, dq, {p.batch, p.max_seqlen_q});
      c->doc_kv = c->add_values(DType::i32, dk, {p.batch, p.max_seqlen_kv});
    }
  }
  if (p.mask.kv_valid_bits) {
    const int words = (p.max_seqlen_kv + 31) / 32;
    std::vector<std::uint32_t> bits(static_cast<std::size_t>(p.batch) * words);
    for (auto& w : bits) w = static_cast<std::uint32_t>(rng()) | static_cast<std::uint32_t>(rng());
    c->kv_valid = c->add_values(DType::u32, bits, {p.batch, words});
  }

  // Sparsity pattern (rows of sequence b use that sequence's block counts; some rows empty).
  const int Bs = c->pattern_batch(), Hs = c->hs(), nQB = c->max_q_blocks();
  c->partial_rows.assign(static_cast<std::size_t>(Bs) * Hs * nQB, {});
  c->full_rows.assign(c->partial_rows.size(), {});
  std::vector<std::vector<int>> proxy_rows(c->partial_rows.size());
  const bool explicit_proxy = spec.proxy == Proxy::explicit_set;
  if (spec.format != Format::all_blocks) {
    for (int b = 0; b < Bs; ++b) {
      // With Bs = 1 the pattern must fit every sequence: use the smallest block counts.
      int qbs = c->q_blocks(b), kbs = c->kv_blocks(b);
      if (Bs == 1 && !varlen) qbs = c->max_q_blocks(), kbs = c->max_kv_blocks();
      for (int h = 0; h < Hs; ++h)
        for (int qb = 0; qb < qbs; ++qb) {
          const std::size_t r = c->row(b, h, qb);
          if (chance(0.1)) {  // empty row
            if (explicit_proxy)
              for (int kb = 0; kb < kbs; ++kb) proxy_rows[r].push_back(kb);
            continue;
          }
          for (int kb = 0; kb < kbs; ++kb) {
            if (!chance(spec.density)) {
              if (explicit_proxy && chance(spec.explicit_fraction)) proxy_rows[r].push_back(kb);
              continue;
            }
            if (p.has_full && chance(0.4)) c->full_rows[r].push_back(kb);
            else c->partial_rows[r].push_back(kb);
          }
        }
    }
  }

  // Write the pattern in the problem's format.
  const int nKB = c->max_kv_blocks();
  auto emit_set = [&](const std::vector<std::vector<int>>& rows, BlockSet& host, BlockSet& dev) {
    // One metadata tensor of the set, on both sides.
    const auto attach = [&](TensorView BlockSet::*field, Buffer* buf) {
      buf->upload();
      host.*field = buf->view(Device::cpu);
      dev.*field = buf->view(Device::cuda);
    };
    switch (spec.format) {
      case Format::all_blocks: return;
      case Format::block_lists: {
        std::vector<std::int32_t> cnt(rows.size()), idx(rows.size() * nKB, -1);
        for (std::size_t r = 0; r < rows.size(); ++r) {
          cnt[r] = static_cast<std::int32_t>(rows[r].size());
          for (std::size_t i = 0; i < rows[r].size(); ++i) idx[r * nKB + i] = rows[r][i];
        }
        attach(&BlockSet::counts, c->add_values(DType::i32, cnt, {Bs, Hs, nQB}));
        attach(&BlockSet::indices, c->add_values(DType::i32, idx, {Bs, Hs, nQB, nKB}));
        return;
      }
      case Format::varlen_block_lists: {
        std::vector<std::int32_t> cum{0}, cidx{0};
        for (int b = 0; b < p.batch; ++b) {
          cum.push_back(cum.back() + c->q_blocks(b));
          cidx.push_back(cidx.back() + c->q_blocks(b) * c->kv_blocks(b));
        }
        std::vector<std::int32_t> cnt(static_cast<std::size_t>(Hs) * std::max(cum.back(), 1)),
            idx(static_cast<std::size_t>(Hs) * std::max(cidx.back(), 1), -1);
        const int tm = std::max(cum.back(), 1), tn = std::max(cidx.back(), 1);
        for (int b = 0; b < p.batch; ++b)
          for (int h = 0; h < Hs; ++h)
            for (int qb = 0; qb < c->q_blocks(b); ++qb) {
              const auto& list = rows[c->row(b, h, qb)];
              cnt[static_cast<std::size_t>(h) * tm + cum[b] + qb] = static_cast<std::int32_t>(list.size());
              for (std::size_t i = 0; i < list.size(); ++i)
                idx[static_cast<std::size_t>(h) * tn + cidx[b] + qb * c->kv_blocks(b) + i] = list[i];
            }
        attach(&BlockSet::counts, c->add_values(DType::i32, cnt, {Hs, tm}));
        attach(&BlockSet::indices, c->add_values(DType::i32, idx, {Hs, tn}));
        return;
      }
      case Format::bsr: {
        std::vector<std::int32_t> indptr{0}, indices;
        auto push = [&](const std::vector<int>& list) {
          for (int x : list) indices.push_back(x);
          indptr.push_back(static_cast<std::int32_t>(indices.size()));
        };
        if (varlen) {
          for (int h = 0; h < Hs; ++h)
            for (int b = 0; b < p.batch; ++b)
              for (int qb = 0; qb < c->q_blocks(b); ++qb) push(rows[c->row(b, h, qb)]);
        } else {
          for (const auto& list : rows) push(list);
        }
        if (indices.empty()) indices.push_back(0);
        attach(&BlockSet::indptr, c->add_values(DType::i32, indptr, {static_cast<std::int64_t>(indptr.size())}));
        attach(&BlockSet::indices, c->add_values(DType::i32, indices, {static_cast<std::int64_t>(indices.size())}));
        return;
      }
      case Format::bitmask: {
        const int W = (nKB + 31) / 32;
        std::vector<std::uint32_t> words;
        Buffer* bw;
        if (varlen) {
          int tm = 0;
          for (int b = 0; b < p.batch; ++b) tm += c->q_blocks(b);
          tm = std::max(tm, 1);
          words.assign(static_cast<std::size_t>(Hs) * tm * W, 0);
          for (int h = 0; h < Hs; ++h) {
            int m = 0;
            for (int b = 0; b < p.batch; ++b)
              for (int qb = 0; qb < c->q_blocks(b); ++qb, ++m)
                for (int kb : rows[c->row(b, h, qb)])
                  words[(static_cast<std::size_t>(h) * tm + m) * W + kb / 32] |= 1u << (kb % 32);
          }
          // Bits past nKB(b) are ignored: set some.
          if (nKB < 32)
            for (auto& w : words) w |= chance(0.2) ? 0x80000000u : 0u;
          bw = c->add_values(DType::u32, words, {Hs, tm, W});
        } else {
          words.assign(rows.size() * W, 0);
          for (std::size_t r = 0; r < rows.size(); ++r)
            for (int kb : rows[r]) words[r * W + kb / 32] |= 1u << (kb % 32);
          bw = c->add_values(DType::u32, words, {Bs, Hs, nQB, W});
        }
        attach(&BlockSet::bits, bw);
        return;
      }
    }
  };
  emit_set(c->partial_rows, c->in_host.partial, c->in_device.partial);
  if (p.has_full) emit_set(c->full_rows, c->in_host.full, c->in_device.full);
  if (explicit_proxy) emit_set(proxy_rows, c->in_host.proxy, c->in_device.proxy);
  for (auto& b : c->buffers) b->upload();
  c->bind_views();
  if (spec.proxy != Proxy::off) {
    Problem host = p;
    host.device = Device::cpu;
    host.validate = true;
    c->k_summary = c->add(p.dtype, {p.batch, c->max_kv_blocks(), p.heads_kv, D});
    c->v_summary = c->add(p.dtype, {p.batch, c->max_kv_blocks(), p.heads_kv, D});
    build_summaries(host, c->in_host, c->k_summary->view(Device::cpu), c->v_summary->view(Device::cpu));
    c->k_summary->upload();
    c->v_summary->upload();
    c->bind_views();
  }
  c->name = std::string(to_string(spec.format)) + (varlen ? " varlen" : " batched") +
            (p.dtype == DType::bf16 ? " bf16" : " f16") + " D=" + std::to_string(D) + " block=(" +
            std::to_string(spec.bq) + "," + std::to_string(spec.bk) + ") Hq=" + std::to_string(p.heads_q) +
            " Hkv=" + std::to_string(p.heads_kv) + " Hs=" + std::to_string(p.sparsity_heads) +
            " Bs=" + std::to_string(p.sparsity_batch) + " B=" + std::to_string(p.batch) + " mask=" +
            std::to_string(mask) + " proxy=" + to_string(spec.proxy) + " seed=" + std::to_string(spec.seed);
  c->poison_outputs();
  return c;
}

inline float load_out(const Buffer* b, std::size_t i) {
  const auto* bits = reinterpret_cast<const std::uint16_t*>(b->host.data());
  switch (b->dtype) {
    case DType::bf16: return cpu::bf16_to_float(bits[i]);
    case DType::f16: return cpu::half_to_float(bits[i]);
    default: return reinterpret_cast<const float*>(b->host.data())[i];
  }
}

// Masks that leave each query row a prefix of its keys, so that with every block selected the
// routes follow from the sequence lengths (route::routes_follow_lengths): none, causal in both
// alignments, a right window with sinks, causal with sinks.
struct PrefixMask {
  int mask;  // CaseSpec mask: 0 none, 1 causal
  bool top_left;
  int window_right, sinks;  // set on a mask-free case: a right window and sinks, not causal
};
inline constexpr PrefixMask kPrefixMasks[] = {
    {0, false, -1, 0}, {1, false, -1, 0}, {1, true, -1, 0}, {0, false, 37, 20}, {1, false, -1, 24}};

// Sets the mask's alignment, right window and sinks on a case made with spec.mask = v.mask, and a
// route capacity of one record per row (which route preparation would overflow); returns a label.
inline std::string apply_prefix_mask(Case& c, const PrefixMask& v) {
  c.problem.mask.alignment = v.top_left ? Alignment::top_left : Alignment::bottom_right;
  c.problem.mask.window_right = v.window_right;
  c.problem.mask.sink_tokens = v.sinks;
  c.problem.max_routes_per_row = 1;
  return " mask " + std::to_string(v.mask) + (v.top_left ? " top-left" : "") + " window_right " +
         std::to_string(v.window_right) + " sinks " + std::to_string(v.sinks);
}

}  // namespace bsattn_gpu_test
