// Metadata value checks on the GPU (validate = true on a GPU plan): the rules of
// formats/validate_values.cpp run where the metadata lies and raise one flag word, so a valid call
// brings nothing but that word to the host (issue 14: one small copy). A raised flag tells the
// plan to read the metadata on the host, where validate_values() names the first bad value.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "formats/value_checks.hpp"

namespace bsattn::gpu {

// Enqueues the checks on `stream`: flags[kValuesInvalidWord] (prepare_routes.hpp) becomes 1 if a
// value breaks a rule, else 0 (a problem without metadata, batched dense attention, launches
// nothing: its flag stays 0). `cu_m` and `cu_idx` ([B+1], device) receive the varlen block offsets
// the lengths imply (the values route preparation derives). Route preparation given
// RouteParams::values_invalid prepares nothing while the flag is raised, so no kernel reads through
// a bad value.
cudaError_t check_values(const formats::ValueCheckParams& checks, std::int32_t* flags, std::int32_t* cu_m,
                         std::int32_t* cu_idx, cudaStream_t stream);

}  // namespace bsattn::gpu
