// The NCCL transport of context parallelism (distributed.hpp), in the library bsattn::nccl (built
// where CMake finds NCCL): one rank per GPU of an NCCL communicator the caller made (it is used,
// not destroyed; it must outlive the transport). It moves device memory only.
//
//   ncclComm_t comm;  ncclCommInitRank(&comm, world, id, rank);     // the caller's set-up
//   auto transport = bsattn::distributed::nccl_transport(comm);
//   bsattn::distributed::attention(*transport, local, sharding, q, k, v, block_mask, out, lse, stream);
//
// all_gather() runs two NCCL all-gathers (the list lengths, then the lists) on the transport's
// own stream and waits for them: the ranks' agreement on the used chunks is host knowledge.
// post() makes that stream wait for the caller's stream, then runs every send and receive in one
// NCCL group on it; Exchange::wait() makes the caller's stream wait for the group, so the
// attention on the chunks a rank holds, enqueued before it, overlaps the transfers.
#pragma once
#include <nccl.h>

#include <memory>

#include "bsattn/distributed.hpp"

namespace bsattn::distributed {

std::unique_ptr<Transport> nccl_transport(ncclComm_t comm);

}  // namespace bsattn::distributed
