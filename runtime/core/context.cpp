// The context's lifetime and parameters: creation (key, tunables from options and the environment,
// transports, the wake and event descriptors, the progress thread), destruction, counters, the Hello
// and metadata it shows peers, and sg_context_set_param / get_param.
#include "core/core.hpp"
#include "core/cuda_plugin.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace sg::core {

namespace {

// An SG_* tunable from the environment, held to the bounds sg_context_set_param enforces: a value
// that is not a plain decimal number inside them refuses the context instead of running with
// whatever strtoull made of it.
bool env_param(const char *name, sg_param_t p, uint64_t &out) {
    const char *text = std::getenv(name);
    if (!text) return false;
    const ParamBounds b = param_bounds(p);
    errno = 0;
    char *end = nullptr;
    const unsigned long long v = std::strtoull(text, &end, 10);
    if (!*text || *end || errno == ERANGE || text[0] == '-' || v < b.lo || v > b.hi)
        fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + "='" + text + "' is not a number in [" + std::to_string(b.lo) +
                                          ", " + std::to_string(b.hi) + "]");
    out = v;
    return true;
}

}  // namespace

KvPool::KvPool(Context *c, const sg_kv_layout_t &pub) : ctx(c), layout(kv::make_layout(pub)), id(random_u64()) {

    const uint32_t rpl = layout.regions_per_layer();
    bases.resize(size_t(layout.num_layers) * rpl);
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
        bases[size_t(l) * rpl] = static_cast<uint8_t *>(pub.layer_k_base[l]);
        if (rpl == 2) bases[size_t(l) * rpl + 1] = static_cast<uint8_t *>(pub.layer_v_base[l]);
    }
    if (layout.mem_kind == SG_MEM_CUDA) check_cuda_pool(layout.device, bases);
}

ParamBounds param_bounds(sg_param_t p) {
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: return {0, 64ull << 20};
        case SG_PARAM_MAX_OP_BYTES: return {4096, 1ull << 30};
        case SG_PARAM_MAX_OPS_IN_FLIGHT: return {1, 4096};
        case SG_PARAM_PROGRESS_SPIN_US: return {0, 1000000};
        case SG_PARAM_STAGING_POLICY: return {SG_STAGING_AUTO, SG_STAGING_NEVER};
    }
    fail(SG_ERR_INVALID_ARGUMENT, "unknown sg_param_t " + std::to_string(int(p)));
}

Context::Context(const sg_context_options_t &opt) : id(random_u64()), opt_(opt) {
    log = Logger(parse_log_level(std::getenv("SG_LOG_LEVEL"), opt.log_level), opt.log_fn, opt.log_user);
    std::string key_warning;
    key_ = auth::load_key(opt.auth_key, opt.auth_key_len, key_warning);
    if (!key_warning.empty()) log.log(SG_LOG_WARN, key_warning);
    if (key_.empty() && !opt.allow_unauthenticated)
        fail(SG_ERR_AUTH_REQUIRED, "no authentication key: set options.auth_key or SG_AUTH_KEY_FILE, or set "
                                   "options.allow_unauthenticated for a trusted network");
    // The options struct outlives nothing; the key now lives only in key_.
    opt_.auth_key = nullptr;
    opt_.auth_key_len = 0;
    spin_us_ = opt.progress_spin_us;
    if (uint64_t v; env_param("SG_PROGRESS_SPIN_US", SG_PARAM_PROGRESS_SPIN_US, v)) spin_us_ = uint32_t(v);
    budget_.max_ops = opt.max_ops_in_flight ? opt.max_ops_in_flight : defaults::kMaxOpsInFlight;
    // SG_PEER_TIMEOUT_MS changes the default (not an explicit option): for hosts, and for test runs
    // under ThreadSanitizer, whose slowdown can keep a progress thread from its keep-alives for 2 s.
    uint64_t default_timeout_ms = defaults::kPeerTimeoutMs;
    if (const char *env = std::getenv("SG_PEER_TIMEOUT_MS"); env && *env) {
        errno = 0;
        char *end = nullptr;
        const unsigned long long v = std::strtoull(env, &end, 10);
        if (*end || errno == ERANGE || env[0] == '-' || v < 100 || v > 3600000)
            fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_PEER_TIMEOUT_MS='") + env + "' is not a number in [100, 3600000]");
        default_timeout_ms = v;
    }
    peer_timeout_ns_ = uint64_t(opt.peer_timeout_ms ? opt.peer_timeout_ms : default_timeout_ms) * 1000000;
    // Soak and canary traffic turn on end-to-end verification without a rebuild of the host.
    if (const char *env = std::getenv("SG_TRANSFER_VERIFY"); env && *env) {
        if (std::strcmp(env, "0") != 0 && std::strcmp(env, "1") != 0)
            fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_TRANSFER_VERIFY='") + env + "' is not 0 or 1");
        verify_transfers_ = env[0] == '1';
    }
    if (opt.max_bytes_in_flight) budget_.max_bytes = opt.max_bytes_in_flight;
    if (opt.max_session_bytes_in_flight) budget_.max_session_bytes = opt.max_session_bytes_in_flight;
    if (opt.max_transfers_per_session) max_transfers_per_session_ = opt.max_transfers_per_session;
    boot_id_ = read_boot_id();
    netns_ = read_netns_inode();

    std::string prov = transport::canonical_provider(opt.provider ? opt.provider : "");
    // Rails: local_addr may name several addresses; the first is where discovery looks.
    std::vector<std::string> rails;
    for (std::string list = opt.local_addr ? opt.local_addr : "127.0.0.1"; !list.empty();) {
        const size_t comma = list.find(',');
        rails.push_back(list.substr(0, comma));
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
    }
    const std::string addr = rails[0];
    uint32_t lanes = opt.lanes;  // 0 for callers built before 0.2 (the ABI fills what they lack)
    bool explicit_lanes = lanes != 0;
    if (const char *env = std::getenv("SG_LANES"); env && *env) {
        char *end = nullptr;
        const unsigned long v = std::strtoul(env, &end, 10);
        if (*end || v > 16) fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_LANES=") + env + " is not a lane count of 0 to 16");
        lanes = uint32_t(v);
        explicit_lanes = lanes != 0;
    }
    // The default: one lane per rail named; else two for tcp, which moved 1.5x more bulk than one
    // on loopback here (docs/benchmarks.md, issue 17); one elsewhere (verbs and efa choose their
    // own memory keys, which lanes cannot share yet).
    const bool tcp = prov.empty() || prov == "auto" || prov == "tcp;ofi_rxm";
    if (lanes == 0) lanes = rails.size() > 1 ? uint32_t(rails.size()) : tcp ? 2 : 1;
    explicit_lanes = explicit_lanes || rails.size() > 1;
    // Tuning and tests: writes below this many bytes stay on lane 0 (transport/lanes.cpp).
    uint64_t lane_small_write_bytes = transport::OpenOptions{}.lane_small_write_bytes;
    if (const char *env = std::getenv("SG_LANE_SMALL_WRITE_BYTES"); env && *env) {
        char *end = nullptr;
        lane_small_write_bytes = std::strtoull(env, &end, 10);
        if (*end) fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_LANE_SMALL_WRITE_BYTES=") + env + " is not a byte count");
    }
    std::vector<std::string> to_open;
    if (prov.empty() || prov == "auto") {
        auto ranked = transport::rank_candidates(transport::discover(addr.c_str()));
        int r = transport::choose_remote(ranked);
        if (r < 0) fail(SG_ERR_NO_PROVIDER, "no usable libfabric provider (run smartgen-info for the reasons)");
        to_open.push_back(ranked[size_t(r)].caps.provider);
        // A same-host peer can use shared memory; open it too when present.
        int l = transport::choose_local(ranked);
        if (l >= 0 && ranked[size_t(l)].caps.provider == "shm") to_open.push_back("shm");
    } else {
        to_open.push_back(prov);
    }
    for (size_t i = 0; i < to_open.size(); ++i) {
        transport::OpenOptions o;
        o.provider = to_open[i];
        o.local_addr = addr;
        o.recv_buffer_bytes = wire::kMaxFrameBytes;
        // Lanes stripe over connections; shm has none, and its peers are on this host.
        if (to_open[i] != "shm") {
            o.lanes = to_open[i] == "tcp;ofi_rxm" || explicit_lanes ? lanes : 1;
            o.lane_small_write_bytes = lane_small_write_bytes;
            if (rails.size() > 1) o.rail_addrs = rails;
        }
        o.lane_threads = to_open[i] != "fake";  // the fake fabric's schedules stay one thread's
        try {
            transports.push_back(transport::open(o));
            transport_options_.push_back(o);
        } catch (const Error &e) {
            if (i == 0) throw;
            log.log(SG_LOG_INFO, "optional provider " + to_open[i] + " not opened: " + e.message());
        }
    }
    primary_provider = transports[0]->caps().provider;
    env_param("SG_STAGING_THRESHOLD", SG_PARAM_STAGING_THRESHOLD, staging_threshold_);
    env_param("SG_STAGING_POLICY", SG_PARAM_STAGING_POLICY, staging_policy_);
    max_op_bytes_ = 16ull << 20;  // each session holds it to its own provider's max_msg_size

    cookie_store_.reserve(size_t(budget_.max_ops) + 64);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0) fail(SG_ERR_INTERNAL, std::string("eventfd: ") + std::strerror(errno));
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) fail(SG_ERR_INTERNAL, std::string("eventfd/epoll: ") + std::strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    for (auto &t : transports)
        if (t->wait_fd() >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, t->wait_fd(), &ev);
    log.log(SG_LOG_INFO, "context on " + primary_provider + (transports.size() > 1 ? " (+shm for same-host peers)" : ""));
    if (!opt.manual_progress) progress_ = std::thread([this] { progress_loop(); });
}

Context::~Context() {
    {
        std::lock_guard lock(select_mu_);
        select_stop_ = true;
    }
    select_cv_.notify_all();
    if (select_thread_.joinable()) select_thread_.join();
    stop_ = true;
    wake();
    if (progress_.joinable()) progress_.join();
    {
        std::lock_guard lock(mu);
        active_.clear();
        lingering_.clear();
        unpacks_.clear();
        packs_.clear();
    }
    transports.clear();
    retired_transports_.clear();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (event_fd_ >= 0) ::close(event_fd_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
}

sg_context_stats_t Context::stats() {
    std::lock_guard lock(mu);
    sg_context_stats_t s = counters;
    s.registrations = 0;
    for (auto &t : transports) s.registrations += t->live_registrations();
    for (auto &t : retired_transports_) s.registrations += t->live_registrations();
    s.lanes = 0;
    for (auto &t : transports) {
        const auto lanes = t->lane_stats();
        s.lanes = std::max<uint64_t>(s.lanes, lanes.lanes);
        s.lane_failovers += lanes.failovers;
        s.lanes_lost += lanes.lanes_lost;
    }
    return s;
}

void Context::signal_event() {
    uint64_t one = 1;
    (void)!::write(event_fd_, &one, sizeof one);
}

void Context::wake() {
    uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof one);
}

wire::Hello Context::hello() const {
    std::lock_guard lock(const_cast<std::mutex &>(mu));  // transports may be renewed meanwhile
    wire::Hello h;
    h.ctx_id = id;
    h.boot_id = boot_id_;
    h.netns_inode = netns_;
    // One endpoint per lane, all under the provider's name, lane 0 first: a peer before 0.2 takes
    // the first of a name it knows and stripes nothing.
    for (auto &t : transports)
        for (auto &address : t->lane_addresses()) h.endpoints.push_back({t->caps().provider, address});
    if (!key_.empty()) {
        h.auth = wire::AuthMode::HmacSha256;
        h.nonce = auth::random_nonce();
    }
    return h;
}

std::vector<uint8_t> Context::metadata() const {
    std::vector<uint8_t> out;
    wire::encode(out, id, hello());
    if (!key_.empty()) {
        const auth::Mac mac = auth::blob_mac(key_, out);
        out.insert(out.end(), mac.begin(), mac.end());
    }
    return out;
}

void Context::set_param(sg_param_t p, uint64_t v) {
    std::lock_guard lock(mu);
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: staging_threshold_ = v; break;
        case SG_PARAM_MAX_OP_BYTES: max_op_bytes_ = v; break;
        case SG_PARAM_MAX_OPS_IN_FLIGHT: budget_.max_ops = uint32_t(v); break;
        case SG_PARAM_PROGRESS_SPIN_US: spin_us_ = uint32_t(v); break;
        case SG_PARAM_STAGING_POLICY: staging_policy_ = v; break;
    }
    wake();
}

uint64_t Context::get_param(sg_param_t p) const {
    std::lock_guard lock(const_cast<std::mutex &>(mu));
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: return staging_threshold_;
        case SG_PARAM_MAX_OP_BYTES: return max_op_bytes_;
        case SG_PARAM_MAX_OPS_IN_FLIGHT: return budget_.max_ops;
        case SG_PARAM_PROGRESS_SPIN_US: return spin_us_;
        case SG_PARAM_STAGING_POLICY: return staging_policy_;
    }
    return 0;
}

}  // namespace sg::core
