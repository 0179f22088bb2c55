// Authentication below the ABI: the proofs' properties, and a peer whose blob passed but who cannot
// prove the key over the fabric (as an impostor replaying a stolen blob would) — it is refused on
// both sides and never learns a memory key.
#include "core/auth.hpp"
#include "core/core.hpp"

#include <gtest/gtest.h>

#include <cstring>

namespace {

using namespace sg;
using core::auth::Key;

Key key_of(const char *s) { return Key(std::span(reinterpret_cast<const uint8_t *>(s), std::strlen(s))); }

TEST(Auth, ProofsBindDirectionNonceAndKey) {
    const Key k = key_of("unit-test-key-0123456789abcdef-0123456"), other = key_of("unit-test-key-0123456789abcdef-0123457");
    const auto n1 = core::auth::random_nonce(), n2 = core::auth::random_nonce();
    ASSERT_EQ(n1.size(), 32u);
    EXPECT_NE(n1, n2);
    const auto p = core::auth::fabric_proof(k, 1, 2, n1);
    EXPECT_EQ(p.size(), 32u);
    EXPECT_TRUE(core::auth::mac_equal(p, core::auth::fabric_proof(k, 1, 2, n1)));
    EXPECT_FALSE(core::auth::mac_equal(p, core::auth::fabric_proof(k, 2, 1, n1)));  // reflected
    EXPECT_FALSE(core::auth::mac_equal(p, core::auth::fabric_proof(k, 1, 2, n2)));  // replayed
    EXPECT_FALSE(core::auth::mac_equal(p, core::auth::fabric_proof(other, 1, 2, n1)));
    const std::vector<uint8_t> a{1, 2, 3}, b{4, 5};
    using core::auth::Role;
    const auto acc = Role::Acceptor, con = Role::Connector;
    EXPECT_FALSE(core::auth::mac_equal(core::auth::bootstrap_proof(k, acc, a, b), core::auth::bootstrap_proof(k, acc, b, a)));
    // The role is bound: an acceptor's proof over (its Hello, the peer's) is not a connector's, so
    // a relay between two acceptors cannot pass one's proof to the other.
    EXPECT_FALSE(core::auth::mac_equal(core::auth::bootstrap_proof(k, acc, a, b), core::auth::bootstrap_proof(k, con, a, b)));
    EXPECT_FALSE(core::auth::mac_equal(core::auth::bootstrap_verdict(k, acc, a, b), core::auth::bootstrap_verdict(k, con, a, b)));
    EXPECT_FALSE(core::auth::mac_equal(core::auth::bootstrap_verdict(k, acc, a, b), core::auth::bootstrap_proof(k, acc, a, b)));
    // Length-prefixed parts: moving a byte across the boundary changes the proof.
    const std::vector<uint8_t> a2{1, 2}, b2{3, 4, 5};
    EXPECT_FALSE(core::auth::mac_equal(core::auth::bootstrap_proof(k, acc, a, b), core::auth::bootstrap_proof(k, acc, a2, b2)));
    EXPECT_FALSE(core::auth::mac_equal(core::auth::blob_mac(k, a), core::auth::bootstrap_proof(k, acc, a, {})));
}

sg_context_options_t options(const char *key) {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.provider = "tcp";
    o.log_level = SG_LOG_OFF;
    o.auth_key = key;
    o.auth_key_len = std::strlen(key);
    return o;
}

TEST(Auth, APeerThatCannotProveTheKeyOverTheFabricGetsNoMemoryKey) {
    core::Context honest(options("the-real-shared-key-0123456789abcdef")),
        impostor(options("not-the-real-key-0123456789abcdef-xx"));
    sg_session_options_t so{};
    so.struct_size = sizeof so;
    // As if each had loaded a blob that verified: the fabric challenge-response is what remains.
    auto at_honest = honest.open_session(impostor.hello(), so, false);
    auto at_impostor = impostor.open_session(honest.hello(), so, false);
    for (auto *pair : {&at_honest, &at_impostor}) {
        core::Context *ctx = (*pair)->ctx;
        try {
            (*pair)->wait_ready(5'000'000'000ull);
            ADD_FAILURE() << "session became ready";
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_AUTH_FAILED) << e.message();
        }
    }
    std::lock_guard lock(impostor.mu);
    EXPECT_FALSE(at_impostor->have_peer_staging);
    EXPECT_TRUE(at_impostor->remote_pools.empty());
    EXPECT_GE(impostor.counters.auth_failures, 1u);
}

}  // namespace
