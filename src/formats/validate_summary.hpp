// Validation of build_summaries() on the GPU beyond validate_summary_build() (validate.hpp):
// throws bsattn::Error naming the argument; writes nothing.
#pragma once
#include "bsattn/problem.hpp"

namespace bsattn::formats {

// The summary kernel runs one CTA per (batch, KV block, KV head): B * nKB * Hkv must fit a
// one-dimensional grid (int32).
void validate_summary_launch(const Problem& problem);

}  // namespace bsattn::formats
