// The route stream (SPEC §5): what every attention engine reads, whatever the input format.
#pragma once
#include <cstdint>

namespace bsattn::route {

enum class RouteKind : std::uint8_t {
  exact = 0,  // a KV tile of tile_n tokens, computed token by token
  proxy = 1,  // one summary term for an omitted KV block (SPEC §6)
};

// One record, 8 bytes. A route row is one (b, hs, q_tile); its Q tile holds tile_m / unit_m
// Q units (unit_m = min(Bq, tile_m)), and `rows` / `masked` carry one bit per unit, so Q blocks
// smaller than the tile share it with per-unit masking.
struct Route {
  std::int32_t index;  // exact: KV tile (tokens [index * tile_n, +tile_n)); proxy: KV block
  std::uint8_t kind;   // RouteKind
  std::uint8_t rows;   // bit u: unit u takes this route
  std::uint8_t masked;  // bit u: unit u evaluates the token mask on it (partial); others are full
  std::uint8_t reserved;
};
static_assert(sizeof(Route) == 8, "route records are 8 bytes");

constexpr int kMaxUnitsPerTile = 8;

}  // namespace bsattn::route
