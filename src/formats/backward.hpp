// The backward's tensors: structural validation (O, LSE, dO and the three gradients, plus the
// forward's inputs) and binding into BackwardParams. Metadata values are checked by
// validate_values(), as for the forward.
#pragma once
#include "bsattn/backward.hpp"
#include "bsattn/backward_params.hpp"

namespace bsattn::formats {

// Every rule the backward adds to the forward's (docs/VALIDATION.md): the problem has a backward
// (no proxy, no paged KV); O, LSE, dO (and dLSE when given) match the problem; dq, dk, dv are shaped like Q, K, V in
// problem.dtype or f32, contiguous along D, and overlap nothing else. Then the inputs' structure.
void validate_backward(const Problem& problem, const Inputs& inputs, const BackwardInputs& backward,
                       const Gradients& gradients);

// Addresses and strides of every tensor. Does not read metadata values.
BackwardParams bind_backward(const Problem& problem, const TileShape& tiles, int capacity, const Inputs& inputs,
                             const BackwardInputs& backward, const Gradients& gradients);

}  // namespace bsattn::formats
