// Validation of problems and bound tensors (SPEC §8; the rules and their decisions are in
// docs/VALIDATION.md), in three layers, one file each: the problem alone at plan time
// (validate_problem.cpp), tensor structure on every run with no metadata value read
// (validate_structure.cpp), and metadata values when problem.validate is set
// (validate_values.cpp). Every check throws bsattn::Error naming the argument, and the row and
// value where there is one, before the engine runs; none writes anything.
#pragma once
#include <cstdint>
#include <vector>

#include "bsattn/plan.hpp"

namespace bsattn::formats {

// Plan time: sizes, head divisibility, supported block and tile sizes, format/feature combinations.
void validate_problem(const Problem& problem, const TileShape& tiles);

// Every run: ranks, shapes, dtypes, strides, alignment, devices, int32 extents, presence of the
// tensors the problem's features need, outputs not overlapping inputs.
void validate_structure(const Problem& problem, const Inputs& inputs, const Outputs& outputs);

// validate = true: metadata values (indices in range, ascending and unique, counts within
// capacity, monotone indptr / cu_*, page ids in range, lengths within the cache). Reads host
// copies of the metadata tensors.
void validate_values(const Problem& problem, const TileShape& tiles, const Inputs& inputs);

// The sequence-length metadata of the problem's layout (cu_seqlens_q/k and seqused_k, or
// seq_lens_kv): structure always; values when problem.validate (then with paged KV also the
// block_table page ids of each sequence's live prefix).
void validate_lengths(const Problem& problem, const TileShape& tiles, const Inputs& inputs);

// build_summaries(): K, V and their sequence-length metadata (structure; values when
// problem.validate) and the two summary outputs (shape, dtype, alignment, no overlap).
void validate_summary_build(const Problem& problem, const TileShape& tiles, const Inputs& inputs,
                            const TensorView& k_summary, const TensorView& v_summary);

// validate_lengths() with values (whatever problem.validate says), returning the exclusive prefix
// sum of nQB(b) the lengths imply ([B+1]).
std::vector<std::int64_t> checked_m_block_offsets(const Problem& problem, const TileShape& tiles, const Inputs& inputs);

}  // namespace bsattn::formats
