// tests/support: what the test programs share: host_pool.hpp (this), pair_harness.hpp (the
// two-process harness), etcd_cluster.hpp (a real etcd cluster), test_context.hpp (the integration
// tests' context). HostPool: a KV pool of 16-bit elements (fp16) in host memory, K and V separate, one allocation per layer and plane, token-major and packed, with the
// sg_kv_layout_t that describes it; the tests' own pool types derive from it and add what they
// check (fills, expected values, a registration).
#pragma once

#include <smartgen/smartgen.h>

#include <cstdint>
#include <vector>

namespace sgtest {

struct PoolShape {
    uint32_t layers, heads, head_dim, tokens_per_block;
    uint64_t blocks;
};

class HostPool {
  public:
    explicit HostPool(const PoolShape &s, uint16_t k_fill = 0, uint16_t v_fill = 0)
        : k(s.layers, std::vector<uint16_t>(size_t(s.blocks) * s.tokens_per_block * s.heads * s.head_dim, k_fill)),
          v(s.layers, std::vector<uint16_t>(k.empty() ? 0 : k[0].size(), v_fill)) {
        for (uint32_t l = 0; l < s.layers; ++l) {
            kp.push_back(k[l].data());
            vp.push_back(v[l].data());
        }
        // The fields sg_kv_layout_init sets, set here: the fake-fabric tests and the fuzzers link
        // the runtime without the C ABI.
        layout = sg_kv_layout_t{};
        layout.struct_size = sizeof layout;
        layout.packing = SG_KV_SEPARATE;
        layout.mem_kind = SG_MEM_HOST;
        layout.num_layers = s.layers;
        layout.num_kv_heads = s.heads;
        layout.head_dim = s.head_dim;
        layout.tokens_per_block = s.tokens_per_block;
        layout.num_blocks = s.blocks;
        layout.dtype = SG_DTYPE_FP16;
        layout.block_order = SG_BLOCK_TOKEN_MAJOR;
        layout.layer_k_base = kp.data();
        layout.layer_v_base = vp.data();
        layout.layer_base_count = s.layers;
    }
    // The layout points into this object's vectors: it stays where it was made.
    HostPool(const HostPool &) = delete;
    HostPool &operator=(const HostPool &) = delete;

    std::vector<std::vector<uint16_t>> k, v;  // [layer][element]
    std::vector<void *> kp, vp;
    sg_kv_layout_t layout;
};

}  // namespace sgtest
