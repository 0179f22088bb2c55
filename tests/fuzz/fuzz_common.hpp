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
#include "support/host_pool.hpp"

#include <smartgen/smartgen.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace sg::fuzz {

// The C API's defaults (sg::defaults, common/common.hpp: the table abi/ applies), without linking
// the ABI; progress driven by the harness, peers never time out (a slow input must not look like a lost peer), logging off.
inline sg_context_options_t context_options(bool keyed = true, const char *provider = "tcp") {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.header_version = SG_VERSION_NUMBER;
    o.provider = provider;
    o.local_addr = "127.0.0.1";
    o.manual_progress = 1;
    o.progress_spin_us = 0;
    o.max_ops_in_flight = sg::defaults::kMaxOpsInFlight;
    o.log_level = SG_LOG_OFF;
    o.peer_timeout_ms = 3600u * 1000u;
    o.max_bytes_in_flight = sg::defaults::kMaxBytesInFlight;
    o.max_session_bytes_in_flight = sg::defaults::kMaxSessionBytesInFlight;
    o.max_transfers_per_session = sg::defaults::kMaxTransfersPerSession;
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
struct HostPool : sgtest::HostPool {
    static constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 16, kTokensPerBlock = 4;
    static constexpr uint64_t kBlocks = 8;
    static constexpr size_t kElems = size_t(kBlocks) * kTokensPerBlock * kHeads * kDim;
    std::shared_ptr<core::KvPool> pool;

    explicit HostPool(core::Context &ctx)
        : sgtest::HostPool({kLayers, kHeads, kDim, kTokensPerBlock, kBlocks}, 0x3c00, 0x3c00),
          pool(std::make_shared<core::KvPool>(&ctx, layout)) {}
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
    s->close(now_ns() + 1000000);
}

}  // namespace sg::fuzz
