// Provider ranking: pure functions over capability tables, so the rules are unit-tested with fake
// tables for fabrics this machine does not have (verbs, efa).
#include "transport/transport.hpp"

#include <rdma/fabric.h>

#include <algorithm>

namespace sg::transport {

std::string canonical_provider(const std::string &name) {
    if (name == "tcp") return "tcp;ofi_rxm";
    if (name == "verbs") return "verbs;ofi_rxm";
    return name;
}

namespace {

int preference(const std::string &prov) {
    if (prov == "verbs;ofi_rxm") return 0;
    if (prov == "efa") return 1;
    if (prov == "tcp;ofi_rxm") return 2;
    if (prov == "shm") return 10;  // same host only
    return -1;
}

}  // namespace

std::vector<Candidate> rank_candidates(std::vector<Candidate> found) {
    constexpr uint64_t need = FI_MSG | FI_RMA;
    constexpr uint64_t known_mr = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    for (Candidate &c : found) {
        const int pref = preference(c.caps.provider);
        c.usable = false;
        c.rank = -1;
        if (!c.rdm) {
            c.reason = "rejected: no FI_EP_RDM endpoint";
        } else if ((c.caps.caps & need) != need) {
            c.reason = std::string("rejected: lacks ") + ((c.caps.caps & FI_RMA) ? "FI_MSG" : "FI_RMA");
        } else if (c.caps.mr_mode & ~known_mr & ~uint64_t(FI_MR_HMEM | FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT)) {
            c.reason = "rejected: needs an MR mode SmartGen does not implement (FI_MR_ENDPOINT or FI_MR_RAW)";
        } else if (pref < 0) {
            c.reason = "rejected: not a provider SmartGen runs on (utility or layered-only provider)";
        } else {
            c.usable = true;
            c.rank = pref;
            if (c.caps.provider == "shm")
                c.reason = "usable for peers on this host and network namespace (CMA / shared memory)";
            else if (pref < 2)
                c.reason = "usable: RDMA-capable, ranked ahead of tcp";
            else
                c.reason = "usable: runs everywhere (sockets), manual progress";
        }
    }
    std::stable_sort(found.begin(), found.end(), [](const Candidate &a, const Candidate &b) {
        const int ra = a.usable ? a.rank : 1000, rb = b.usable ? b.rank : 1000;
        return ra < rb;
    });
    return found;
}

int choose_remote(const std::vector<Candidate> &ranked) {
    for (size_t i = 0; i < ranked.size(); ++i)
        if (ranked[i].usable && ranked[i].caps.provider != "shm") return int(i);
    return -1;
}

int choose_local(const std::vector<Candidate> &ranked) {
    for (size_t i = 0; i < ranked.size(); ++i)
        if (ranked[i].usable && ranked[i].caps.provider == "shm") return int(i);
    return choose_remote(ranked);
}

}  // namespace sg::transport
