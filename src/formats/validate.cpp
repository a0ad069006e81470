#include "formats/validate.hpp"

namespace bsattn::formats {

void validate_problem(const Problem& problem, const TileShape&) {
  if (problem.heads_kv <= 0 || problem.heads_q % problem.heads_kv != 0)
    throw Error("problem.heads_q", "not divisible by heads_kv");
}

void validate_structure(const Problem&, const Inputs&, const Outputs&) {}

void validate_values(const Problem&, const TileShape&, const Inputs&) {}

}  // namespace bsattn::formats
