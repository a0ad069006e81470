// Validation of select_blocks() (SPEC §7, §8): the problem, the options, Q, the K summaries, the
// sequence lengths and the bitmask output. Every check throws bsattn::Error naming the argument;
// none writes anything.
#pragma once
#include "bsattn/select.hpp"

namespace bsattn::formats {

// The Problem select_blocks() validates and binds: `problem` with the fields selection does not
// read (format, sets, mask, proxy) reset, so that only its geometry and layouts are checked.
Problem selection_geometry(const Problem& problem);

// The options alone: known enum values, top_k >= 1, finite tau, mass in (0, 1], sinks / local >= 0.
void validate_select_options(const SelectOptions& options);

// Structure always; with problem.validate also the sequence-length values and, varlen, that the
// bitmask has at least total_m_blocks rows.
void validate_select(const Problem& problem, const TileShape& tiles, const Inputs& inputs,
                     const SelectOptions& options, const TensorView& bits);

}  // namespace bsattn::formats
