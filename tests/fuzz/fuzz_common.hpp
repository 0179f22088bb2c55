// tests/fuzz: what the fuzzers share — context options for in-process contexts, a small host KV
// pool, and the rule for what counts as a finding.
//
// Contexts are made with core::Context directly (the fuzzers link the runtime archive, not the
// shared library), over "tcp" with no progress thread (the harness drives progress, so one input
// runs the same way each time as far as the fabric allows), logging off, authenticated with the
// tests' pre-shared key (tests/test_key.h). Refusals are sg::Error; anything else that escapes a
// runtime call, and every sanitizer report, is a finding.
#pragma once

#include "common/common.hpp"
#include "core/core.hpp"

#include "../test_key.h"

#include <smartgen/smartgen.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace sg::fuzz {

// The C API's defaults (abi/abi.cpp), without linking the ABI: progress driven by the harness,
// peers never time out (a slow input must not look like a lost peer), logging off.
inline sg_context_options_t context_options(bool keyed = true, const char *provider = "tcp") {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.header_version = SG_VERSION_NUMBER;
    o.provider = provider;
    o.local_addr = "127.0.0.1";
    o.manual_progress = 1;
    o.progress_spin_us = 0;
    o.max_ops_in_flight = 64;
    o.log_level = SG_LOG_OFF;
    o.peer_timeout_ms = 3600u * 1000u;
    o.max_bytes_in_flight = 64ull << 20;
    o.max_session_bytes_in_flight = 32ull << 20;
    o.max_transfers_per_session = 1024;
    if (keyed)
        SG_TEST_USE_KEY(o);
    else
        o.allow_unauthenticated = true;
    return o;
}

inline sg_session_options_t session_options() {
    sg_session_options_t o{};
    o.struct_size = sizeof o;
    return o;
}

inline sg_transfer_options_t transfer_options(uint32_t paths = SG_PATH_FULL, uint32_t flags = 0) {
    sg_transfer_options_t o{};
    o.struct_size = sizeof o;
    o.paths = paths;
    o.flags = flags;
    return o;
}

// Creating a context opens libfabric endpoints; a failure here is the machine's, not a finding.
inline std::unique_ptr<core::Context> make_context(bool keyed = true, const char *provider = "tcp") {
    setenv("SG_LOG_LEVEL", "off", 1);  // read at context creation; overrides the options' level
    try {
        return std::make_unique<core::Context>(context_options(keyed, provider));
    } catch (const Error &e) {
        std::fprintf(stderr, "fuzz: cannot create a context over %s: %s\n", provider, e.message().c_str());
        std::abort();
    }
}

// A small host pool: fp16, separate K and V, token-major.
struct HostPool {
    static constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 16, kTokensPerBlock = 4;
    static constexpr uint64_t kBlocks = 8;
    static constexpr size_t kElems = size_t(kBlocks) * kTokensPerBlock * kHeads * kDim;
    std::vector<std::vector<uint16_t>> k, v;
    std::vector<void *> kp, vp;
    sg_kv_layout_t layout{};
    std::shared_ptr<core::KvPool> pool;

    explicit HostPool(core::Context &ctx) {
        k.assign(kLayers, std::vector<uint16_t>(kElems, 0x3c00));
        v.assign(kLayers, std::vector<uint16_t>(kElems, 0x3c00));
        for (uint32_t l = 0; l < kLayers; ++l) {
            kp.push_back(k[l].data());
            vp.push_back(v[l].data());
        }
        layout.struct_size = sizeof layout;
        layout.num_layers = kLayers;
        layout.num_kv_heads = kHeads;
        layout.head_dim = kDim;
        layout.tokens_per_block = kTokensPerBlock;
        layout.num_blocks = kBlocks;
        layout.dtype = SG_DTYPE_FP16;
        layout.packing = SG_KV_SEPARATE;
        layout.block_order = SG_BLOCK_TOKEN_MAJOR;
        layout.mem_kind = SG_MEM_HOST;
        layout.layer_k_base = kp.data();
        layout.layer_v_base = vp.data();
        layout.layer_base_count = kLayers;
        pool = std::make_shared<core::KvPool>(&ctx, layout);
    }
};

}  // namespace sg::fuzz


namespace sg::fuzz {

// The tests' key as an auth::Key, for harnesses that sign or prove what a key holder would.
inline const core::auth::Key &test_key() {
    static const core::auth::Key key(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t *>(sg_test_auth_key), sizeof sg_test_auth_key - 1));
    return key;
}

// What sg_session_from_metadata and sg_session_accept do with a Hello that passed its checks: open a
// session with the peer it names (its endpoint names go to the fabric's address vector), then close
// it. The peer's id is made the lower one first, so this context never speaks first and never
// connects to an address the fuzzer made up; nothing leaves the process.
inline void open_and_close(core::Context &ctx, wire::Hello peer, bool authenticated) {
    if (peer.ctx_id == ctx.id) return;
    peer.ctx_id = peer.ctx_id < ctx.id ? peer.ctx_id : ctx.id - 1;
    if (peer.ctx_id == 0) return;
    std::shared_ptr<core::Session> s;
    try {
        s = ctx.open_session(peer, session_options(), authenticated);
    } catch (const Error &) {
        return;  // refused: no common provider, an address the fabric does not take, ...
    }
    // Nothing was handed to the provider (the peer speaks first), so a short drain loses nothing.
    ctx.close_session(*s, now_ns() + 1000000);
}

}  // namespace sg::fuzz
