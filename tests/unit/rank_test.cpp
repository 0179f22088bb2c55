// Unit tests for provider ranking (runtime/transport/rank.cpp) over hand-made capability tables, so
// the rules are checked for fabrics this machine lacks (verbs, efa), plus one real discovery.
#include "transport/transport.hpp"

#include <gtest/gtest.h>
#include <rdma/fabric.h>

#include <string>
#include <vector>

namespace sg::transport {
namespace {

constexpr uint64_t kRdmaMr = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;

Candidate cand(const std::string &provider, const std::string &domain, uint64_t caps = FI_MSG | FI_RMA,
               uint64_t mr_mode = 0, bool rdm = true) {
    Candidate c;
    c.caps.provider = provider;
    c.caps.domain = domain;
    c.caps.caps = caps;
    c.caps.mr_mode = mr_mode;
    c.rdm = rdm;
    c.usable = true;  // ranking must decide this itself, not trust the input
    c.rank = 99;
    return c;
}

// The full table, deliberately in an order unlike the ranking.
std::vector<Candidate> full_table() {
    return {
        cand("sockets", "lo"),                                            // runs, but not a provider we use
        cand("tcp;ofi_rxm", "eth0"),                                      // mr_mode 0
        cand("udp;ofi_rxd", "eth0", FI_MSG | FI_RMA, 0, false),           // no RDM endpoint
        cand("shm", "shm", FI_MSG | FI_RMA, FI_MR_VIRT_ADDR),              // same host only
        cand("verbs;ofi_rxm", "mlx5_1", FI_MSG, kRdmaMr),                  // lacks FI_RMA
        cand("efa", "rdmap0s1", FI_MSG | FI_RMA, kRdmaMr | FI_MR_ENDPOINT),  // MR regime not implemented
        cand("efa", "rdmap1s2", FI_MSG | FI_RMA, kRdmaMr),
        cand("verbs;ofi_rxm", "mlx5_0", FI_MSG | FI_RMA, kRdmaMr),
    };
}

const Candidate *find(const std::vector<Candidate> &r, const std::string &provider, const std::string &domain) {
    for (const Candidate &c : r)
        if (c.caps.provider == provider && c.caps.domain == domain) return &c;
    return nullptr;
}

bool mentions(const Candidate &c, const char *what) { return c.reason.find(what) != std::string::npos; }

TEST(Rank, OrdersVerbsEfaTcpThenShmThenRejected) {
    const std::vector<Candidate> r = rank_candidates(full_table());
    ASSERT_EQ(r.size(), 8u);  // nothing is dropped: rejected entries stay, with their reason
    EXPECT_EQ(r[0].caps.provider, "verbs;ofi_rxm");
    EXPECT_EQ(r[0].caps.domain, "mlx5_0");
    EXPECT_EQ(r[1].caps.provider, "efa");
    EXPECT_EQ(r[1].caps.domain, "rdmap1s2");
    EXPECT_EQ(r[2].caps.provider, "tcp;ofi_rxm");
    EXPECT_EQ(r[3].caps.provider, "shm");
    for (int i = 0; i < 4; ++i) {
        EXPECT_TRUE(r[i].usable) << r[i].caps.provider;
        EXPECT_GE(r[i].rank, 0);
        if (i) EXPECT_LT(r[i - 1].rank, r[i].rank);  // strictly better first
    }
    for (size_t i = 4; i < r.size(); ++i) {
        EXPECT_FALSE(r[i].usable) << r[i].caps.provider << " " << r[i].caps.domain;
        EXPECT_EQ(r[i].rank, -1);
    }
    EXPECT_TRUE(mentions(r[3], "same host") || mentions(r[3], "this host")) << r[3].reason;
}

TEST(Rank, RejectionsSayWhatIsMissing) {
    const std::vector<Candidate> r = rank_candidates(full_table());
    const Candidate *no_rma = find(r, "verbs;ofi_rxm", "mlx5_1");
    const Candidate *endpoint_mr = find(r, "efa", "rdmap0s1");
    const Candidate *no_rdm = find(r, "udp;ofi_rxd", "eth0");
    const Candidate *sockets = find(r, "sockets", "lo");
    ASSERT_TRUE(no_rma && endpoint_mr && no_rdm && sockets);
    for (const Candidate *c : {no_rma, endpoint_mr, no_rdm, sockets}) {
        EXPECT_FALSE(c->usable) << c->caps.provider;
        EXPECT_EQ(c->rank, -1) << c->caps.provider;
        EXPECT_TRUE(mentions(*c, "rejected")) << c->reason;
    }
    EXPECT_TRUE(mentions(*no_rma, "FI_RMA")) << no_rma->reason;
    EXPECT_TRUE(mentions(*endpoint_mr, "MR mode")) << endpoint_mr->reason;
    EXPECT_TRUE(mentions(*no_rdm, "RDM")) << no_rdm->reason;
    EXPECT_FALSE(sockets->reason.empty());

    // Lacking FI_MSG is named as such (RMA alone cannot carry the control messages).
    const std::vector<Candidate> m = rank_candidates({cand("tcp;ofi_rxm", "eth0", FI_RMA)});
    EXPECT_FALSE(m[0].usable);
    EXPECT_TRUE(mentions(m[0], "FI_MSG")) << m[0].reason;

    // FI_MR_RAW is another regime this runtime does not implement; HMEM and MMU_NOTIFY are harmless.
    const std::vector<Candidate> raw = rank_candidates({cand("verbs;ofi_rxm", "a", FI_MSG | FI_RMA, kRdmaMr | FI_MR_RAW),
                                                        cand("verbs;ofi_rxm", "b", FI_MSG | FI_RMA,
                                                             kRdmaMr | FI_MR_HMEM | FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT)});
    EXPECT_EQ(raw[0].caps.domain, "b");
    EXPECT_TRUE(raw[0].usable);
    EXPECT_FALSE(raw[1].usable);
    EXPECT_TRUE(mentions(raw[1], "MR mode")) << raw[1].reason;
}

TEST(Rank, ChoosesRemoteAndLocalPeers) {
    const std::vector<Candidate> r = rank_candidates(full_table());
    const int remote = choose_remote(r), local = choose_local(r);
    ASSERT_GE(remote, 0);
    ASSERT_GE(local, 0);
    EXPECT_EQ(r[size_t(remote)].caps.provider, "verbs;ofi_rxm");
    EXPECT_EQ(r[size_t(remote)].caps.domain, "mlx5_0");  // not the one lacking FI_RMA
    EXPECT_EQ(r[size_t(local)].caps.provider, "shm");

    // Without RDMA hardware the remote choice falls back to tcp; shm is still preferred locally.
    std::vector<Candidate> no_rdma;
    for (const Candidate &c : full_table())
        if (c.caps.provider != "verbs;ofi_rxm" && c.caps.provider != "efa") no_rdma.push_back(c);
    const std::vector<Candidate> t = rank_candidates(no_rdma);
    ASSERT_GE(choose_remote(t), 0);
    EXPECT_EQ(t[size_t(choose_remote(t))].caps.provider, "tcp;ofi_rxm");
    ASSERT_GE(choose_local(t), 0);
    EXPECT_EQ(t[size_t(choose_local(t))].caps.provider, "shm");

    // Without shm, a local peer uses whatever a remote one would.
    std::vector<Candidate> no_shm;
    for (const Candidate &c : full_table())
        if (c.caps.provider != "shm") no_shm.push_back(c);
    const std::vector<Candidate> n = rank_candidates(no_shm);
    EXPECT_EQ(choose_local(n), choose_remote(n));
    EXPECT_EQ(n[size_t(choose_local(n))].caps.provider, "verbs;ofi_rxm");

    // Only shm (and rejected entries): nothing reaches another host.
    const std::vector<Candidate> s = rank_candidates({cand("sockets", "lo"), cand("shm", "shm", FI_MSG | FI_RMA, FI_MR_VIRT_ADDR),
                                                      cand("udp;ofi_rxd", "eth0", FI_MSG | FI_RMA, 0, false)});
    EXPECT_EQ(choose_remote(s), -1);
    ASSERT_GE(choose_local(s), 0);
    EXPECT_EQ(s[size_t(choose_local(s))].caps.provider, "shm");

    // Nothing at all.
    const std::vector<Candidate> none = rank_candidates({});
    EXPECT_EQ(choose_remote(none), -1);
    EXPECT_EQ(choose_local(none), -1);
}

TEST(Rank, KeepsInputOrderWithinARank) {
    const std::vector<Candidate> r = rank_candidates(
        {cand("tcp;ofi_rxm", "eth1"), cand("shm", "shm"), cand("tcp;ofi_rxm", "lo"), cand("tcp;ofi_rxm", "eth0")});
    ASSERT_EQ(r.size(), 4u);
    EXPECT_EQ(r[0].caps.domain, "eth1");
    EXPECT_EQ(r[1].caps.domain, "lo");
    EXPECT_EQ(r[2].caps.domain, "eth0");
    EXPECT_EQ(r[3].caps.provider, "shm");
    EXPECT_EQ(choose_remote(r), 0);
}

TEST(Rank, CanonicalProviderNames) {
    EXPECT_EQ(canonical_provider("tcp"), "tcp;ofi_rxm");
    EXPECT_EQ(canonical_provider("verbs"), "verbs;ofi_rxm");
    EXPECT_EQ(canonical_provider("shm"), "shm");
    EXPECT_EQ(canonical_provider("efa"), "efa");
    EXPECT_EQ(canonical_provider("tcp;ofi_rxm"), "tcp;ofi_rxm");
    EXPECT_EQ(canonical_provider(""), "");
    // The canonical name is the one ranking recognises.
    const std::vector<Candidate> r = rank_candidates({cand(canonical_provider("tcp"), "eth0")});
    EXPECT_TRUE(r[0].usable);
}

// Real libfabric on this machine: tcp;ofi_rxm is installed and must come out usable.
TEST(Rank, DiscoverFindsUsableTcpHere) {
    const std::vector<Candidate> r = rank_candidates(discover(nullptr));
    ASSERT_FALSE(r.empty()) << "fi_getinfo found no provider at all";
    bool tcp_usable = false;
    for (const Candidate &c : r) {
        if (c.caps.provider == "tcp;ofi_rxm" && c.usable) tcp_usable = true;
        EXPECT_FALSE(c.reason.empty()) << c.caps.provider;  // every entry says why
    }
    EXPECT_TRUE(tcp_usable);
    const int remote = choose_remote(r);
    ASSERT_GE(remote, 0);
    EXPECT_TRUE(r[size_t(remote)].usable);
    EXPECT_NE(r[size_t(remote)].caps.provider, "shm");
}

}  // namespace
}  // namespace sg::transport
