// Links the installed NCCL transport (bsattn::nccl): a null communicator is refused by name.
#include <bsattn/distributed_nccl.hpp>

#include <cstdio>

int main() {
  try {
    bsattn::distributed::nccl_transport(nullptr);
  } catch (const bsattn::Error& e) {
    std::printf("refused: %s\n", e.what());
    return 0;
  }
  return 1;
}
