// Internal to core/: what the selective paths' files (paths_prefill.cpp, paths_prefill_units.cpp,
// paths_decode.cpp) share: the prefill side's bounds, block counts and sizes of a request and the
// digests' wire encoding.
#pragma once

#include "core/core.hpp"

#include <cstring>

namespace sg::core::paths {

// Digests go as control messages in runs below the frame limit.
inline constexpr uint64_t kDigestChunkBytes = 192 * 1024;
// Speculative bytes in flight per session: what an on-demand fetch may find ahead of it (50 us at
// 10 Gbit/s). Completed writes have left the socket buffer, so this bound also keeps the kernel's
// queue short. Measured on a 10 Gbit/s link: at 2 MiB a fetch waited 2-3 ms behind bulk, at 128 KiB
// 0.47-0.52 ms (1.8-2.0x idle), at 64 KiB 0.26-0.31 ms (0.8-1.3x), with the bulk alone at the
// link's rate each time; over loopback 64 KiB holds speculative bulk to about 2.5 GB/s.
inline constexpr uint64_t kSpeculativeInflightBytes = 64 * 1024;
// Speculative writes are cut to this size so the bound above is fine-grained.
inline constexpr uint64_t kSpeculativeOpBytes = 64 * 1024;
// A decode step fetches layer after layer, each a round trip after the last: for this long after a
// fetch the speculative path posts nothing new, so the step's later fetches find the link idle.
// It must outlast a fetch's own round trip, which includes what the kernel's socket buffers and the
// link's queue already hold (writes complete when handed to the kernel, so the in-flight bound
// does not count those bytes).
inline constexpr uint64_t kSpeculativeYieldNs = 10000000;
// Proactive bytes in flight per session: whatever sits in the provider's queue when decode starts its
// step is ahead of token 1's message and of the step's first fetch. Two staging slots while layers
// are being written (enough to keep a 10 Gbit/s link busy: ~7 ms of it), 256 KiB once the decode side
// may be fetching: after a fetch, and from the moment every layer is written. Measured on a 10 Gbit/s
// link with the session's 32 MiB as the only bound: the first five fetches of a step waited 25-41 ms
// each behind the last layers' proactive writes, token 1's message 80 ms; the later fetches 1-2 ms.
inline constexpr uint64_t kProactiveInflightBytes = 8ull << 20;
inline constexpr uint64_t kProactiveFetchFriendlyBytes = 256 * 1024;
// Size of one speculative unit: small enough that the path yields often, large enough that its
// notices cost little.
inline constexpr uint64_t kSpeculativeUnitBytes = 512 * 1024;
// Where the transport keeps bulk apart (lanes: speculative writes on lanes > 0, fetch replies and
// every message on lane 0), the speculative bytes in flight are not what a fetch finds ahead of it in
// its socket buffer: they wait in their own. Writes there complete when delivered, so this bound is
// what may be between the two processes, kernel buffers included, and it must cover the delivery
// acknowledgement's round trip at the link's rate: at 64 KiB (the bound above) the path carried
// about 170 MB/s over a 10 Gbit/s link, at 16 MiB the link's rate. The pause after a fetch stays: the
// bulk still shares the link's queue with the fetches, and a drop-tail queue that bulk keeps full
// makes a fetch wait behind it and lose packets with it (measured: step 2's 32 fetches waited
// 250-280 ms without the pause, 68-98 ms with it).
inline constexpr uint64_t kApartSpeculativeInflightBytes = 16ull << 20;
// Larger writes where the bulk is apart: a connection of small writes carries less (one iperf3
// stream over the shaped link: 64 KiB writes 5.2 Gbit/s, 1 MB 9.5).
inline constexpr uint64_t kApartSpeculativeOpBytes = 256 * 1024;
// A provider for peers on this host (shm) has no socket buffer: what a fetch finds ahead of it is
// what is in flight, copied at memory speed. 2 MiB is about 0.5 ms of it, and lets the path keep
// up with a prefill that writes a layer every 10 ms (the 64 KiB bound held it near 2.5 GB/s, below
// the 3.2 GB/s an emulated 8K-token Llama-3-8B's layers arrive at, so step 2 selected and fetched
// where streaming had every layer in place).
inline constexpr uint64_t kLocalSpeculativeInflightBytes = 2ull << 20;

// Blocks named in one BlocksReady or Fetch message (64 KiB of ids, far below the frame limit).
inline constexpr size_t kMaxBlocksPerMessage = 16384;

inline uint32_t request_blocks(const Transfer &t) {
    return uint32_t(kernels::num_blocks(t.num_tokens, t.pool->layout.tokens_per_block));
}

// Payload bytes of one block of one layer (K and V).
inline uint64_t block_bytes(const kv::Layout &L) { return 2 * L.plane_bytes; }

inline uint64_t digest_block_bytes(const kv::Layout &L) {
    return kernels::digest_floats(1, L.num_kv_heads, L.head_dim) * L.elem_bytes;
}

// Digests travel and are kept in the pool's dtype: min and max of stored keys are stored keys, so
// nothing is lost.
inline void encode_digests(const kv::Layout &L, const float *digest, size_t n, uint8_t *out) {
    switch (L.dtype) {
        case SG_DTYPE_FP16:
            for (size_t i = 0; i < n; ++i) {
                const uint16_t h = kernels::float_to_fp16(digest[i]);
                std::memcpy(out + 2 * i, &h, 2);
            }
            break;
        case SG_DTYPE_BF16:
            for (size_t i = 0; i < n; ++i) {
                const uint16_t h = kernels::float_to_bf16(digest[i]);
                std::memcpy(out + 2 * i, &h, 2);
            }
            break;
        default: std::memcpy(out, digest, n * sizeof(float));
    }
}

}  // namespace sg::core::paths
