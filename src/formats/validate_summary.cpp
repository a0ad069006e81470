#include "formats/validate_summary.hpp"

#include <cstdint>
#include <limits>
#include <string>

#include "bsattn/route/params.hpp"

namespace bsattn::formats {

void validate_summary_launch(const Problem& problem) {
  const std::int64_t items = static_cast<std::int64_t>(problem.batch) *
                             route::ceil_div(problem.max_seqlen_kv, problem.block.kv) * problem.heads_kv;
  if (items > std::numeric_limits<std::int32_t>::max())
    throw Error("problem.max_seqlen_kv", "batch * ceil(max_seqlen_kv / block.kv) * heads_kv = " + std::to_string(items) +
                                             " summary rows exceed the GPU grid limit of 2^31 - 1");
}

}  // namespace bsattn::formats
