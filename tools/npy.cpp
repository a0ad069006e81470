#include "npy.hpp"

#include <fstream>
#include <vector>

#include "workload.hpp"

namespace bsattn::tools {

void save_npy_f32(const std::string& path, const TensorView& t) {
  std::string shape = "(";
  for (int i = 0; i < t.rank; ++i) shape += std::to_string(t.shape[i]) + (t.rank == 1 || i + 1 < t.rank ? "," : "");
  shape += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Format 1.0: magic (6) + version (2) + length (2) + header, padded with spaces to a multiple
  // of 64 and ended by a newline.
  const std::size_t unpadded = 10 + header.size() + 1;
  header += std::string((64 - unpadded % 64) % 64, ' ') + "\n";

  const std::int64_t n = t.numel();
  std::vector<float> values(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) values[i] = element_as_float(t, i);
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error("save-outputs", "cannot write " + path);
  const unsigned char len[2] = {static_cast<unsigned char>(header.size() & 0xff), static_cast<unsigned char>(header.size() >> 8)};
  f.write("\x93NUMPY\x01\x00", 8);
  f.write(reinterpret_cast<const char*>(len), 2);
  f << header;
  f.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!f) throw Error("save-outputs", "failed writing " + path);
}

}  // namespace bsattn::tools
