// A custom token mask: a functor bool(b, h, q_idx, kv_idx) (sequence-local indices) that ANDs
// with the built-in mask on partial blocks (SPEC §4). Header-only so that the functor is inlined
// into the engine. The CPU engine runs it; a GPU entry point comes with the GPU kernels.
#pragma once
#include "bsattn/backward.hpp"
#include "bsattn/cpu/backward.hpp"
#include "bsattn/cpu/engine.hpp"
#include "bsattn/plan.hpp"

namespace bsattn {

template <class MaskFn>
struct CustomTokenMask {
  static constexpr bool kActive = true;
  MaskFn fn;
  bool operator()(int b, int h, int q, int kv) const { return static_cast<bool>(fn(b, h, q, kv)); }
};

// Runs `plan` with `mask_fn` ANDed into the token mask. The plan must be for the CPU.
template <class MaskFn>
void run_with_mask(Plan& plan, const Inputs& inputs, const Outputs& outputs, const MaskFn& mask_fn) {
  const CustomTokenMask<MaskFn> mask{mask_fn};
  plan.run_cpu_engine(
      inputs, outputs,
      [](const void* context, AttentionParams& params, const cpu::Workspace& ws) {
        params.route.custom_mask = true;
        cpu::run(params, ws, *static_cast<const CustomTokenMask<MaskFn>*>(context));
      },
      &mask);
}

// plan + run_with_mask with full validation.
template <class MaskFn>
void attention_with_mask(const Problem& problem, const Inputs& inputs, const Outputs& outputs, const MaskFn& mask_fn) {
  Problem p = problem;
  p.validate = true;
  Plan plan(p);
  run_with_mask(plan, inputs, outputs, mask_fn);
}

// The backward of run_with_mask: the same functor selects the same pairs. The plan must be for the CPU.
template <class MaskFn>
void run_backward_with_mask(Plan& plan, const Inputs& inputs, const BackwardInputs& backward,
                            const Gradients& gradients, const MaskFn& mask_fn) {
  const CustomTokenMask<MaskFn> mask{mask_fn};
  plan.run_cpu_backward_engine(
      inputs, backward, gradients,
      [](const void* context, BackwardParams& params, const cpu::Workspace& ws) {
        params.fwd.route.custom_mask = true;
        cpu::run_backward(params, ws, *static_cast<const CustomTokenMask<MaskFn>*>(context));
      },
      &mask);
}

// plan + run_backward_with_mask with full validation.
template <class MaskFn>
void attention_backward_with_mask(const Problem& problem, const Inputs& inputs, const BackwardInputs& backward,
                                  const Gradients& gradients, const MaskFn& mask_fn) {
  Problem p = problem;
  p.validate = true;
  Plan plan(p);
  run_backward_with_mask(plan, inputs, backward, gradients, mask_fn);
}

}  // namespace bsattn
