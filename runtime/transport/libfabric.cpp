// libfabric implementation of Transport: one RDM endpoint, one completion queue for transmit and
// receive, an address vector, and a ring of pre-posted receive buffers for control messages.
#include "transport/transport.hpp"
#include "transport/shm_lock_breaker.hpp"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <ctime>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace sg::transport {

namespace {

// Debian's libfabric links every provider in, and psm's libinfinipath installs SIGINT, SIGTERM,
// SIGSEGV, SIGBUS, SIGILL and SIGABRT handlers from its constructor when libfabric is loaded: a host
// that never asked for them then gets backtrace files (.btr) in its working directory instead of
// the default action, and SIGTERM during a wait crashed inside libfabric. A host's signals are its
// own: once libfabric (a dependency, so constructed first) is loaded, put every disposition that
// points into a library SmartGen does not use back to the default. Handlers the host installs
// itself, before loading us or after, are never touched.
bool installed_by_unwanted_library(const struct sigaction &action) {
    void *handler = (action.sa_flags & SA_SIGINFO) ? reinterpret_cast<void *>(action.sa_sigaction)
                                                    : reinterpret_cast<void *>(action.sa_handler);
    if (!(action.sa_flags & SA_SIGINFO) && (action.sa_handler == SIG_DFL || action.sa_handler == SIG_IGN)) return false;
    Dl_info info{};
    if (!handler || !dladdr(handler, &info) || !info.dli_fname) return false;
    const char *name = std::strrchr(info.dli_fname, '/');
    name = name ? name + 1 : info.dli_fname;
    return std::strncmp(name, "libinfinipath", 13) == 0 || std::strncmp(name, "libpsm", 6) == 0;
}

__attribute__((constructor)) void restore_signal_dispositions() {
    for (int sig : {SIGINT, SIGTERM, SIGQUIT, SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
        struct sigaction current {};
        if (sigaction(sig, nullptr, &current) != 0) continue;
        if (!installed_by_unwanted_library(current)) continue;
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, nullptr);
    }
}

// rxm closes a peer's connection when the peer leaves the address vector only where
// FI_AV_REMOVE_CLEANUP is on, and libfabric reads that once, at its first call. The fence
// (Transport::fence) is that removal: without it a write whose header the provider accepted
// keeps landing after the session that owned the memory is gone. A host that set the variable
// itself keeps its choice (then fence() reports connections it could not close).
bool connection_cleanup_enabled() {
    static const bool enabled = [] {
        ::setenv("FI_AV_REMOVE_CLEANUP", "1", /*overwrite=*/0);
        const char *v = std::getenv("FI_AV_REMOVE_CLEANUP");
        return v && (std::strcmp(v, "1") == 0 || strcasecmp(v, "yes") == 0 || strcasecmp(v, "true") == 0 ||
                     strcasecmp(v, "on") == 0 || strcasecmp(v, "y") == 0);
    }();
    return enabled;
}

std::string fi_text(int rc) { return std::string(fi_strerror(-rc)) + " (" + std::to_string(rc) + ")"; }

[[noreturn]] void fi_fail(const std::string &what, int rc) { fail(SG_ERR_TRANSPORT, what + ": " + fi_text(rc)); }

// Capabilities every SmartGen endpoint needs.
constexpr uint64_t kCaps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
// MR regimes implemented: scalable (0) and the "basic" bits verbs/efa ask for.
constexpr uint64_t kMrModes = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;

struct InfoDeleter {
    void operator()(fi_info *i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

InfoPtr make_hints() {
    InfoPtr hints(fi_allocinfo());
    if (!hints) fail(SG_ERR_NO_MEMORY, "fi_allocinfo failed");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = kCaps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = int(kMrModes);
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
    return hints;
}

Capabilities caps_of(const fi_info *i) {
    Capabilities c;
    c.provider = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
    c.fabric = i->fabric_attr->name ? i->fabric_attr->name : "";
    c.domain = i->domain_attr->name ? i->domain_attr->name : "";
    c.caps = i->caps;
    c.mr_mode = uint64_t(i->domain_attr->mr_mode);
    c.msg_order = i->tx_attr->msg_order;
    c.max_msg_size = i->ep_attr->max_msg_size;
    c.rma_iov_limit = i->tx_attr->rma_iov_limit;
    c.iov_limit = i->tx_attr->iov_limit;
    c.inject_size = i->tx_attr->inject_size;
    c.mr_key_size = i->domain_attr->mr_key_size;
    c.hmem = (i->caps & FI_HMEM) != 0;
    c.needs_local_desc = (c.mr_mode & FI_MR_LOCAL) != 0;
    c.virt_addr = (c.mr_mode & FI_MR_VIRT_ADDR) != 0;
    c.provider_keys = (c.mr_mode & FI_MR_PROV_KEY) != 0;
    c.send_after_write = (c.msg_order & FI_ORDER_SAW) != 0;
    return c;
}

// The shm provider names an endpoint's region "<pid>:<uid>:<endpoint index>" and creates it with
// O_EXCL. A process killed with SIGKILL leaves its regions in /dev/shm, and once its pid comes
// round again (quickly in a container, where pids are small) the new process's fi_enable fails
// with EBUSY. So SmartGen names its regions itself, with 64 random bits, and marks a live one by
// holding a shared flock on it: a region whose lock anyone can take exclusively has no owner, and
// is removed when the next SmartGen shm endpoint opens. The lock works across pid namespaces that
// share /dev/shm, where a pid check would not.
constexpr const char *kShmPrefix = "smartgen-";
// A region is created by fi_enable and locked right after; only a region older than this can be
// judged by its lock, so that a reaper never races a region being born. Its age is its mtime, set
// when the provider sizes it (writes through the mapping leave it alone on tmpfs).
constexpr time_t kShmReapAgeSeconds = 60;

std::string fresh_shm_name() {
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != ssize_t(sizeof nonce))
        nonce = uint64_t(std::time(nullptr)) * 0x9e3779b97f4a7c15ull ^ uint64_t(getpid()) << 20;
    char name[64];
    std::snprintf(name, sizeof name, "%s%d-%016llx", kShmPrefix, int(getpid()), static_cast<unsigned long long>(nonce));
    return name;
}

// True for names fresh_shm_name() makes: the prefix, digits, '-', 16 hex digits, nothing after.
// The provider's per-message files ("<name>_<id>") and anything else are left alone.
bool is_smartgen_region_name(const char *name) {
    const size_t prefix = std::strlen(kShmPrefix);
    if (std::strncmp(name, kShmPrefix, prefix) != 0) return false;
    const char *p = name + prefix;
    const char *digits = p;
    while (*p >= '0' && *p <= '9') ++p;
    if (p == digits || *p != '-') return false;
    ++p;
    for (int i = 0; i < 16; ++i, ++p)
        if (!std::isxdigit(static_cast<unsigned char>(*p))) return false;
    return *p == '\0';
}


// Removes regions of SmartGen shm endpoints whose processes are gone. Best effort: a region
// another user owns, or one that disappears meanwhile, is skipped. Returns how many were removed.
size_t reap_orphaned_shm_regions() {
    DIR *dir = opendir("/dev/shm");
    if (!dir) return 0;
    size_t removed = 0;
    const time_t now = std::time(nullptr);
    while (dirent *entry = readdir(dir)) {
        if (!is_smartgen_region_name(entry->d_name)) continue;
        const int fd = shm_open(entry->d_name, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0) continue;
        struct stat st {};
        const bool old_enough = fstat(fd, &st) == 0 && st.st_uid == geteuid() &&
                                now - st.st_mtime >= kShmReapAgeSeconds;
        if (old_enough && shm::region_owner_gone(fd) && shm_unlink(entry->d_name) == 0) ++removed;
        ::close(fd);
    }
    closedir(dir);
    return removed;
}

}  // namespace

std::vector<Candidate> discover(const char *local_addr) {
    (void)local_addr;  // discovery lists every domain; the address matters when a context opens one
    InfoPtr hints(fi_allocinfo());
    if (!hints) fail(SG_ERR_NO_MEMORY, "fi_allocinfo failed");
    // Ask broadly, so that providers lacking something show up with the reason they are rejected.
    hints->mode = ~uint64_t(0);
    hints->domain_attr->mr_mode = int(FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                      FI_MR_ENDPOINT | FI_MR_RAW | FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT | FI_MR_HMEM);
    fi_info *list = nullptr;
    (void)connection_cleanup_enabled();
    int rc = fi_getinfo(FI_VERSION(1, 17), nullptr, nullptr, 0, hints.get(), &list);
    std::vector<Candidate> out;
    if (rc == -FI_ENODATA) return out;
    if (rc) fi_fail("fi_getinfo", rc);
    InfoPtr owner(list);
    for (fi_info *i = list; i; i = i->next) {
        Candidate c;
        c.caps = caps_of(i);
        c.rdm = i->ep_attr->type == FI_EP_RDM;
        c.caps.mr_mode = uint64_t(i->domain_attr->mr_mode);
        bool seen = false;
        for (auto &o : out)
            if (o.caps.provider == c.caps.provider && o.caps.domain == c.caps.domain && o.rdm == c.rdm) seen = true;
        if (!seen) out.push_back(std::move(c));
    }
    return out;
}

namespace {

// Receive slots and op cookies start with the provider's context space.
struct RecvSlot {
    alignas(16) uint8_t provider_ctx[kCookieBytes];
    uint8_t *buf;
};

class LibfabricTransport final : public Transport {
  public:
    explicit LibfabricTransport(const OpenOptions &opt) { open(opt); }
    ~LibfabricTransport() override { close(); }

    const Capabilities &caps() const override { return caps_; }

    std::vector<uint8_t> local_address() override {
        open_endpoint();
        std::vector<uint8_t> name(256);
        size_t len = name.size();
        int rc = fi_getname(&ep_->fid, name.data(), &len);
        if (rc == -FI_ETOOSMALL) {
            name.resize(len);
            rc = fi_getname(&ep_->fid, name.data(), &len);
        }
        if (rc) fi_fail("fi_getname", rc);
        name.resize(len);
        return name;
    }

    PeerAddr insert_peer(std::span<const uint8_t> address) override {
        open_endpoint();
        // fi_av_insert reads as many bytes as the provider's names have (a string name: up to its
        // NUL), whatever the span holds: a peer's name of another length (empty, say) or a string
        // without its NUL would be read past its end.
        if (info_->addr_format == FI_ADDR_STR) {
            if (address.empty() || std::memchr(address.data(), 0, address.size()) == nullptr)
                fail(SG_ERR_PROTOCOL, "the peer's " + caps_.provider + " endpoint name is not a terminated string");
        } else if (const size_t ours = local_address().size(); address.size() != ours) {
            fail(SG_ERR_PROTOCOL, "the peer's " + caps_.provider + " endpoint name has " + std::to_string(address.size()) +
                                      " bytes, this provider's have " + std::to_string(ours));
        }
        fi_addr_t addr = FI_ADDR_UNSPEC;
        int rc = fi_av_insert(av_, address.data(), 1, &addr, 0, nullptr);
        if (rc != 1) fail(SG_ERR_TRANSPORT, "fi_av_insert of the peer's endpoint name failed: " + fi_text(rc));
        if (shm_lock_fd_ >= 0) watch_shm_peer(addr, reinterpret_cast<const char *>(address.data()));
        std::lock_guard lock(peers_mu_);
        const PeerAddr handle = next_peer_++;
        peers_[handle] = PeerEntry{addr, false};
        AddrUse &use = addr_use_[addr];
        use.live++;
        use.av_refs++;
        return handle;
    }

    void remove_peer(PeerAddr peer) override {
        std::lock_guard lock(peers_mu_);
        auto it = peers_.find(peer);
        if (it == peers_.end()) return;
        const PeerEntry entry = it->second;
        peers_.erase(it);
        if (entry.fenced) return;
        // Where removal closes connections (rxm with FI_AV_REMOVE_CLEANUP), an unfenced peer's
        // address stays in the vector: its connection, which a session that ended with a finished
        // close handshake keeps for the next session between the two endpoints (closing it lost a
        // frame of that next one: Reconnect.* beside a CPU hog). The provider gives the next insert
        // of the name the same entry, so they are bounded by the peers this endpoint has known.
        if (!fence_closes_connections_) {
            leave(entry.addr);
            return;
        }
        auto use = addr_use_.find(entry.addr);
        if (use != addr_use_.end() && use->second.live > 0) use->second.live--;
    }

    // The address leaves the vector at once, which on rxm (FI_AV_REMOVE_CLEANUP) closes the
    // peer's connection under the endpoint's lock: a write of the peer's that is half received
    // stops there, and every operation of ours to it is flushed, its completion an error. The
    // handle stays the caller's until remove_peer; posts to it fail. A connection another live
    // handle still uses (a new session with the same peer while the old one ends: one address, one
    // connection) is not closed: then only the keys fence the old session.
    bool fence(PeerAddr peer) override {
        std::lock_guard lock(peers_mu_);
        auto it = peers_.find(peer);
        if (it == peers_.end()) return fence_closes_connections_;
        if (it->second.fenced) return it->second.closed;
        it->second.fenced = true;
        it->second.closed = leave(it->second.addr) && fence_closes_connections_;
        return it->second.closed;
    }

    Registration register_memory(void *addr, uint64_t len, uint64_t requested_key) override {
        fid_mr *mr = nullptr;
        const uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
        int rc = fi_mr_reg(domain_, addr, len, access, 0, requested_key, 0, &mr, nullptr);
        if (rc) fi_fail("fi_mr_reg of " + std::to_string(len) + " bytes", rc);
        return registered(mr, addr);
    }

    Registration register_device_memory(void *addr, uint64_t len, uint64_t requested_key, int32_t cuda_device) override {
        if (!caps_.hmem) Transport::register_device_memory(addr, len, requested_key, cuda_device);
        iovec iov{addr, len};
        fi_mr_attr attr{};
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
        attr.requested_key = requested_key;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_device;
        fid_mr *mr = nullptr;
        if (int rc = fi_mr_regattr(domain_, &attr, 0, &mr))
            fi_fail("fi_mr_regattr of " + std::to_string(len) + " bytes of CUDA device " + std::to_string(cuda_device), rc);
        return registered(mr, addr);
    }

    Registration registered(fid_mr *mr, void *addr) {
        Registration r;
        r.mr = mr;
        r.desc = fi_mr_desc(mr);
        r.key = fi_mr_key(mr);
        r.remote_base = caps_.virt_addr ? reinterpret_cast<uint64_t>(addr) : 0;
        ++live_registrations_;
        return r;
    }

    void deregister(Registration &reg) noexcept override {
        if (reg.mr) {
            fi_close(&static_cast<fid_mr *>(reg.mr)->fid);
            --live_registrations_;
        }
        reg = Registration{};
    }

    uint64_t live_registrations() const override {
        return live_registrations_ - (recv_reg_.mr ? 1 : 0);
    }

    int post_write(PeerAddr peer, std::span<const LocalIov> local, uint64_t remote_addr, uint64_t key,
                   void *cookie) override {
        iovec iov[8];
        void *desc[8];
        uint64_t total = 0;
        const size_t n = local.size();
        for (size_t i = 0; i < n; ++i) {
            iov[i].iov_base = const_cast<void *>(local[i].addr);
            iov[i].iov_len = local[i].len;
            desc[i] = local[i].desc;
            total += local[i].len;
        }
        fi_rma_iov rma{remote_addr, total, key};
        fi_msg_rma msg{};
        msg.msg_iov = iov;
        msg.desc = desc;
        msg.iov_count = n;
        msg.addr = resolve(peer);
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.context = cookie;
        refuse_if_shm_peer_gone(msg.addr);
        ssize_t rc = fi_writemsg(ep_, &msg, write_flags_);
        if (rc == -FI_EAGAIN) return -EAGAIN;
        if (rc) fi_fail("fi_writemsg", int(rc));
        return 0;
    }

    int post_send(PeerAddr peer, const void *buf, uint64_t len, void *desc, void *cookie) override {
        const fi_addr_t addr = resolve(peer);
        refuse_if_shm_peer_gone(addr);
        ssize_t rc = fi_send(ep_, buf, len, desc, addr, cookie);
        if (rc == -FI_EAGAIN) return -EAGAIN;
        if (rc) fi_fail("fi_send", int(rc));
        return 0;
    }

    size_t poll(CompletionSink &sink) override {
        size_t handled = 0;
        fi_cq_msg_entry entries[32];
        for (;;) {
            ssize_t n = fi_cq_read(cq_, entries, 32);
            if (n == -FI_EAGAIN) break;
            if (n == -FI_EAVAIL) {
                fi_cq_err_entry err{};
                if (fi_cq_readerr(cq_, &err, 0) == 1) {
                    char text[256];
                    const char *t = fi_cq_strerror(cq_, err.prov_errno, err.err_data, text, sizeof text);
                    if (err.flags & FI_RECV) {
                        // A receive failed (e.g. truncated message): say so and keep the slot alive.
                        sink.on_complete(nullptr, -int(err.err), t ? t : fi_strerror(int(err.err)));
                        repost(static_cast<RecvSlot *>(err.op_context));
                    } else {
                        sink.on_complete(err.op_context, -int(err.err), t ? t : fi_strerror(int(err.err)));
                    }
                    handled++;
                }
                continue;
            }
            if (n < 0) fi_fail("fi_cq_read", int(n));
            for (ssize_t k = 0; k < n; ++k) {
                const fi_cq_msg_entry &e = entries[k];
                if (e.flags & FI_RECV) {
                    auto *slot = static_cast<RecvSlot *>(e.op_context);
                    sink.on_message(std::span<const uint8_t>(slot->buf, e.len));
                    repost(slot);
                } else {
                    sink.on_complete(e.op_context, 0, nullptr);
                }
            }
            handled += size_t(n);
            if (n < 32) break;
        }
        return handled;
    }

    int wait_fd() const override { return wait_fd_; }

    bool prepare_wait() override {
        // shm's wait object fires for local completions only, not when the peer writes into our
        // queues: sleeping on it can oversleep a message by the whole timeout.
        if (wait_fd_ < 0 || caps_.local_only) return false;
        fid *f = &cq_->fid;
        return fi_trywait(fabric_, &f, 1) == FI_SUCCESS;
    }

  private:
    // FI_HMEM is asked of the GPUDirect RDMA providers (verbs, EFA) only: shm and tcp report it
    // too, for host memory alone where libfabric is built without CUDA (Debian's), and opening them
    // with it changes their protocols for host pools (shm's then held sockets a soak counted as
    // leaked, and slowed scattered writes until transfers timed out). SG_FI_HMEM=0 asks no provider,
    // SG_FI_HMEM=1 every one.
    static bool hmem_wanted(const std::string &prov) {
        const char *env = std::getenv("SG_FI_HMEM");
        if (env && std::strcmp(env, "0") == 0) return false;
        if (env && std::strcmp(env, "1") == 0) return true;
        return prov.rfind("verbs", 0) == 0 || prov.rfind("efa", 0) == 0;
    }
    // Providers report FI_LOCAL_COMM / FI_REMOTE_COMM only when asked (shm reports neither by
    // default), so ask: does the provider offer an RDM endpoint that talks to other hosts?
    static bool reaches_other_hosts(const std::string &prov, const char *node) {
        InfoPtr hints = make_hints();
        hints->caps |= FI_REMOTE_COMM;
        hints->fabric_attr->prov_name = strdup(prov.c_str());
        fi_info *list = nullptr;
        const int rc = fi_getinfo(FI_VERSION(1, 17), node, nullptr, node ? FI_SOURCE : 0, hints.get(), &list);
        if (list) fi_freeinfo(list);
        return rc == 0;
    }

    void open(const OpenOptions &opt) {
        fence_closes_connections_ = connection_cleanup_enabled();
        InfoPtr hints = make_hints();
        std::string prov = opt.provider.empty() ? "tcp;ofi_rxm" : opt.provider;
        hints->fabric_attr->prov_name = strdup(prov.c_str());
        const bool network = prov != "shm";
        const std::string node = opt.local_addr.empty() ? "127.0.0.1" : opt.local_addr;
        fi_info *list = nullptr;
        int rc = -FI_ENODATA;
        // Device memory by RMA (GPUDirect) where the provider offers it: ask for FI_HMEM first, and
        // open without it when the provider has none, so a host pool never depends on it.
        // FI_MR_HMEM: device buffers then need their local descriptor, which every write passes.
        if (hmem_wanted(prov)) {
            InfoPtr hmem_hints = make_hints();
            hmem_hints->caps |= FI_HMEM;
            hmem_hints->domain_attr->mr_mode |= FI_MR_HMEM;
            hmem_hints->fabric_attr->prov_name = strdup(prov.c_str());
            rc = fi_getinfo(FI_VERSION(1, 17), network ? node.c_str() : nullptr, nullptr, network ? FI_SOURCE : 0,
                            hmem_hints.get(), &list);
            if (rc) list = nullptr;
        }
        if (!list)
            rc = fi_getinfo(FI_VERSION(1, 17), network ? node.c_str() : nullptr, nullptr, network ? FI_SOURCE : 0,
                            hints.get(), &list);
        if (rc == -FI_ENODATA)
            fail(SG_ERR_NO_PROVIDER, "provider '" + prov + "' offers no RDM endpoint with FI_RMA|FI_MSG" +
                                         (network ? " on " + node : std::string()) +
                                         " (run smartgen-info to see why each provider was rejected)");
        if (rc) fi_fail("fi_getinfo for " + prov, rc);
        info_.reset(list);
        caps_ = caps_of(list);
        caps_.provider = prov;  // the layered name ("tcp;ofi_rxm"), which is what users ask for
        caps_.local_only = !reaches_other_hosts(prov, network ? node.c_str() : nullptr);
        // Connections a fence can close: rxm's, one per peer; shm and EFA have none.
        fence_closes_connections_ = fence_closes_connections_ && prov.find("ofi_rxm") != std::string::npos;

        if ((rc = fi_fabric(info_->fabric_attr, &fabric_, nullptr))) fi_fail("fi_fabric", rc);
        if ((rc = fi_domain(fabric_, info_.get(), &domain_, nullptr))) fi_fail("fi_domain", rc);
        fi_av_attr av_attr{};
        av_attr.type = FI_AV_TABLE;
        if ((rc = fi_av_open(domain_, &av_attr, &av_, nullptr))) fi_fail("fi_av_open", rc);
        fi_cq_attr cq_attr{};
        cq_attr.format = FI_CQ_FORMAT_MSG;
        cq_attr.size = 4096;
        cq_attr.wait_obj = FI_WAIT_FD;
        if (fi_cq_open(domain_, &cq_attr, &cq_, nullptr)) {
            cq_attr.wait_obj = FI_WAIT_NONE;  // some providers have no fd; progress then polls
            if ((rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr))) fi_fail("fi_cq_open", rc);
        } else if (fi_control(&cq_->fid, FI_GETWAIT, &wait_fd_)) {
            wait_fd_ = -1;
        }
        // Without send-after-write ordering, a notice may only follow writes that are complete at the
        // target, so writes ask for delivery completion.
        write_flags_ = FI_COMPLETION | (caps_.send_after_write && !opt.delivery_complete ? 0 : FI_DELIVERY_COMPLETE);
        shm_ = prov == "shm";
        recv_buffers_ = opt.recv_buffers ? opt.recv_buffers : 32;
        recv_bytes_ = opt.recv_buffer_bytes ? opt.recv_buffer_bytes : 256 * 1024;
        // A network endpoint waits for the first session (open_endpoint): enabling it is where the
        // provider allocates and touches its buffers (rxm: ~70 MB a tcp lane), most of a context's
        // memory. A shm endpoint (4-8 MB) opens now, as before 0.5: opened during a handshake
        // instead, the soak (a peer process killed and restarted twice, seeds 8 and 12) lost a
        // process to a SIGSEGV inside libfabric's shm progress, or hung, in 3 of 14 runs, against
        // 0 of 14 with it opened here; the cause inside the provider is not found yet.
        if (shm_) open_endpoint();
    }

    void open_endpoint() {
        if (ep_) return;
        try {
            enable_endpoint();
        } catch (...) {
            // Nothing half-open stays behind: the next call tries again from the start.
            if (ep_) fi_close(&ep_->fid);
            ep_ = nullptr;
            if (recv_reg_.mr) deregister(recv_reg_);
            slots_.clear();
            recv_area_.reset();
            shm::unwatch_region(own_breaker_token_);
            own_breaker_token_ = 0;
            if (shm_lock_fd_ >= 0) ::close(shm_lock_fd_);
            shm_lock_fd_ = -1;
            throw;
        }
    }

    void enable_endpoint() {
        int rc;
        if ((rc = fi_endpoint(domain_, info_.get(), &ep_, nullptr))) fi_fail("fi_endpoint", rc);
        if ((rc = fi_ep_bind(ep_, &av_->fid, 0))) fi_fail("fi_ep_bind(av)", rc);
        if ((rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV))) fi_fail("fi_ep_bind(cq)", rc);
        std::string shm_name;
        if (shm_) {
            reap_orphaned_shm_regions();
            shm_name = fresh_shm_name();
            if ((rc = fi_setname(&ep_->fid, shm_name.data(), shm_name.size() + 1))) fi_fail("fi_setname(shm)", rc);
        }
        if ((rc = fi_enable(ep_))) fi_fail("fi_enable", rc);
        if (!shm_name.empty()) {
            shm_lock_fd_ = shm_open(shm_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
            if (shm_lock_fd_ < 0 || flock(shm_lock_fd_, LOCK_SH) != 0)
                fail(SG_ERR_TRANSPORT, "cannot mark shm region " + shm_name + " as in use: " + std::strerror(errno));
            own_breaker_token_ = shm::watch_region(shm_name, true);
        }

        // Left uninitialized: pages are touched only as messages land in them.
        recv_area_.reset(new uint8_t[recv_buffers_ * recv_bytes_]);
        if (caps_.needs_local_desc)
            recv_reg_ = register_memory(recv_area_.get(), recv_buffers_ * recv_bytes_, 0x5347524356ull);
        slots_.resize(recv_buffers_);
        for (size_t i = 0; i < recv_buffers_; ++i) {
            slots_[i].buf = recv_area_.get() + i * recv_bytes_;
            repost(&slots_[i]);
        }
    }

    // libfabric 1.17's shm provider queues a send or a write under a spin lock that lives in the
    // target's region, and the target takes the same lock while it drains its queue. A process
    // killed while it holds that lock leaves it held for good, and the next post to it spins inside
    // the provider with the caller's locks held: in the soak, one SIGKILLed prefill process wedged
    // a decode context (the poster in pthread_spin_lock, the progress thread waiting on the context
    // mutex), so that context never noticed the loss nor took the restarted peer's connection.
    // A SmartGen peer holds a shared flock on its region while it lives (above), so each post first
    // tries that lock: if it can be taken, the owner is gone, and the post fails as a lost
    // connection without entering the provider. That costs one flock call per post to a shm peer.
    // A kill that lands while a post already waits on the peer's spin lock, or while the peer
    // holds ours, is left to the lock breaker (shm_lock_breaker.hpp), which watches both regions.
    struct ShmPeer {
        int fd = -1;
        std::string region;
        uint64_t breaker_token = 0;
    };

    // The provider's address of a peer handle; a fenced peer's is gone.
    fi_addr_t resolve(PeerAddr peer) {
        std::lock_guard lock(peers_mu_);
        auto it = peers_.find(peer);
        if (it == peers_.end()) fail(SG_ERR_INTERNAL, "no peer " + std::to_string(peer) + " on this endpoint");
        if (it->second.fenced) fail(SG_ERR_PEER_LOST, "the connection to the peer was fenced (its session ended)");
        return it->second.addr;
    }

    // One live handle of `addr` is gone (fenced or removed). The last one takes the address out of
    // the vector, once for every insert (the provider counts them): rxm closes the connection at
    // the first removal whatever the count, so none may come while a live handle shares it.
    // Returns whether the address left. With peers_mu_ held.
    bool leave(fi_addr_t addr) {
        auto use = addr_use_.find(addr);
        if (use == addr_use_.end()) return true;
        if (--use->second.live > 0) return false;
        const uint32_t refs = use->second.av_refs;
        addr_use_.erase(use);
        for (uint32_t i = 0; i < refs; ++i) fi_av_remove(av_, &addr, 1, 0);
        {
            std::lock_guard shm_lock(shm_peers_mu_);
            if (auto it = shm_peers_.find(addr); it != shm_peers_.end()) {
                shm::unwatch_region(it->second.breaker_token);
                ::close(it->second.fd);
                shm_peers_.erase(it);
            }
        }
        return true;
    }

    void watch_shm_peer(fi_addr_t addr, const char *name) {
        if (!is_smartgen_region_name(name)) return;  // named by another program, or by the provider
        const int fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0) return;  // already gone: the provider itself then fails the posts
        std::lock_guard lock(shm_peers_mu_);
        auto &p = shm_peers_[addr];
        if (p.fd >= 0) ::close(p.fd);
        shm::unwatch_region(p.breaker_token);
        p.fd = fd;
        p.region = name;
        p.breaker_token = shm::watch_region(name, false);
    }

    void refuse_if_shm_peer_gone(fi_addr_t peer) {
        if (shm_lock_fd_ < 0) return;
        std::lock_guard lock(shm_peers_mu_);
        auto it = shm_peers_.find(peer);
        if (it == shm_peers_.end() || !shm::region_owner_gone(it->second.fd)) return;
        flock(it->second.fd, LOCK_UN);  // a region whose owner is gone is the next reaper's to remove
        fail(SG_ERR_PEER_LOST,
             "the peer's shm endpoint is gone: the process that held region " + it->second.region + " has exited");
    }

    void repost(RecvSlot *slot) {
        for (int tries = 0;; ++tries) {
            ssize_t rc = fi_recv(ep_, slot->buf, recv_bytes_, recv_reg_.desc, FI_ADDR_UNSPEC, slot);
            if (rc == 0) return;
            if (rc != -FI_EAGAIN || tries > 1000) fi_fail("fi_recv", int(rc));
            fi_cq_msg_entry scratch;
            (void)fi_cq_read(cq_, &scratch, 0);  // drives progress without consuming entries
        }
    }

    void close() noexcept {
        if (ep_) fi_close(&ep_->fid);
        if (recv_reg_.mr) deregister(recv_reg_);
        if (cq_) fi_close(&cq_->fid);
        if (av_) fi_close(&av_->fid);
        if (domain_) fi_close(&domain_->fid);
        if (fabric_) fi_close(&fabric_->fid);
        if (shm_lock_fd_ >= 0) ::close(shm_lock_fd_);  // after the provider has removed the region
        for (auto &[addr, p] : shm_peers_) {
            shm::unwatch_region(p.breaker_token);
            ::close(p.fd);
        }
        shm::unwatch_region(own_breaker_token_);
    }

    InfoPtr info_;
    Capabilities caps_;
    fid_fabric *fabric_ = nullptr;
    fid_domain *domain_ = nullptr;
    fid_av *av_ = nullptr;
    fid_cq *cq_ = nullptr;
    fid_ep *ep_ = nullptr;
    int wait_fd_ = -1;
    int shm_lock_fd_ = -1;  // holds a shared flock on this endpoint's shm region while it lives
    uint64_t own_breaker_token_ = 0;  // this endpoint's region, watched by the lock breaker
    std::mutex shm_peers_mu_;  // a lane's thread may post while the core inserts or removes peers
    std::unordered_map<fi_addr_t, ShmPeer> shm_peers_;
    // Peers by handle, not by address: a fenced address leaves the vector at once and the provider
    // may give its slot to the next peer inserted, while the fenced handle is still held.
    struct PeerEntry {
        fi_addr_t addr = FI_ADDR_UNSPEC;
        bool fenced = false;
        bool closed = false;  // the fence closed its connection
    };
    // The provider hands one address to every insert of the same name, and counts the inserts.
    struct AddrUse {
        uint32_t live = 0;     // handles of it not fenced nor removed
        uint32_t av_refs = 0;  // inserts not yet removed from the vector
    };
    std::mutex peers_mu_;  // taken before shm_peers_mu_
    std::unordered_map<PeerAddr, PeerEntry> peers_;
    std::unordered_map<fi_addr_t, AddrUse> addr_use_;
    PeerAddr next_peer_ = 1;
    bool fence_closes_connections_ = false;
    uint64_t write_flags_ = FI_COMPLETION;
    bool shm_ = false;
    size_t recv_buffers_ = 0;
    size_t recv_bytes_ = 0;
    std::unique_ptr<uint8_t[]> recv_area_;
    Registration recv_reg_;
    uint64_t live_registrations_ = 0;
    std::vector<RecvSlot> slots_;
};

}  // namespace

std::unique_ptr<Transport> open_libfabric(const OpenOptions &options) {
    return std::make_unique<LibfabricTransport>(options);
}

namespace {
struct TestProviders {
    std::mutex mu;
    std::map<std::string, OpenFn> by_name;
};
TestProviders &test_providers() {
    static TestProviders *p = new TestProviders;  // never destroyed: registrations run at static init
    return *p;
}
}  // namespace

void register_test_provider(const std::string &name, OpenFn open) {
    auto &t = test_providers();
    std::lock_guard lock(t.mu);
    if (open)
        t.by_name[name] = open;
    else
        t.by_name.erase(name);
}

// A test fabric's name is never a libfabric provider's, and discovery (fi_getinfo) never lists it, so
// only a context that names it gets it; in the shipped library none is registered.
std::unique_ptr<Transport> open(const OpenOptions &options) {
    OpenFn open_one = &open_libfabric;
    {
        auto &t = test_providers();
        std::lock_guard lock(t.mu);
        if (auto it = t.by_name.find(options.provider); it != t.by_name.end()) open_one = it->second;
    }
    if (options.lanes > 1 || options.rail_addrs.size() > 1) return open_striped(options, open_one);
    return open_one(options);
}

}  // namespace sg::transport
