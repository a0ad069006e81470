// The backward pass (gradients of attention): dQ, dK, dV from the forward's inputs, its outputs O
// and LSE, and dO. The same Problem and Inputs as the forward select the same attended pairs
// (every format, partial and full sets, built-in masks, custom functors via custom_mask.hpp,
// GQA/MQA, batched and varlen layouts). CPU engine, and GPU plans made with problem.backward =
// true (f16 / bf16 with out_dtype = dtype; no custom functors: docs/GPU.md); paged KV and proxy
// compensation have no backward.
#pragma once
#include "bsattn/plan.hpp"

namespace bsattn {

// What the backward reads besides the forward's Inputs.
struct BackwardInputs {
  TensorView out;   // O of the forward: Q's layout, problem.out_dtype
  TensorView lse;   // LSE of the forward (required): f32, batched [B, Hq, Sq], varlen [Hq, total_q]
  TensorView dout;  // dL/dO: O's shape and dtype
  // Optional dL/dLSE (LSE's shape, f32), when the loss uses the LSE too: since dLSE/dS = P, it
  // adds P * dlse to dS. Left undefined, the LSE is treated as not part of the loss.
  TensorView dlse;
};

// What it writes, every element (zeros where nothing was attended). dq has Q's shape, dk and dv
// K's and V's (contiguous batched, or packed varlen). Each is in the input dtype (problem.dtype)
// or f32; accumulation is f32 either way and the result is rounded once. Any strides with a
// contiguous last dimension; gradients must not overlap each other or any input.
struct Gradients {
  TensorView dq, dk, dv;
};

// plan + Plan::run_backward with full validation (problem.validate and problem.backward are
// forced on).
void attention_backward(const Problem& problem, const Inputs& inputs, const BackwardInputs& backward,
                        const Gradients& gradients, Stream stream = nullptr);

}  // namespace bsattn
