// Binding: a validated problem and its tensors into the flat AttentionParams of the engines.
#pragma once
#include "bsattn/attention_params.hpp"
#include "bsattn/plan.hpp"

namespace bsattn::formats {

// The engines' element type of a float dtype (f32, f16, bf16).
ElementType element_type(DType dtype);

// Geometry only (no tensor addresses): what plan() knows.
route::RouteParams route_geometry(const Problem& problem, const TileShape& tiles, int capacity);

// Addresses and strides of every tensor. Does not read metadata values.
AttentionParams bind(const Problem& problem, const TileShape& tiles, int capacity, const Inputs& inputs,
                     const Outputs& outputs);

}  // namespace bsattn::formats
