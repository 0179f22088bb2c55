// Internal to core/: what the two sides of the selective paths (paths_prefill.cpp,
// paths_decode.cpp) share: block counts and sizes of a request and the digests' wire encoding.
#pragma once

#include "core/core.hpp"

#include <cstring>

namespace sg::core::paths {

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
