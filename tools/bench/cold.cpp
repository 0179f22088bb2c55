// smartgen-bench cold: what the first transfer of a fresh pair of contexts costs, against a warm one.
//
// Each sample forks nothing new: the peer process (forked once, before any SmartGen call) and this
// one both create fresh contexts, connect a session (authenticated with a pre-shared key), register
// and export a 1 MiB pool (one layer, 64 KiB blocks: 16 tokens x 8 KV heads x 128, fp16, K+V fused),
// and move it once (cold); then move it again over the same session (warm). Times are taken on the
// posting side; "connect" includes waiting for the peer's own context. Medians of --reps.
#pragma GCC diagnostic ignored "-Wrestrict"  // GCC 12 false positive in std::string concatenation

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <smartgen/smartgen.h>
#include <stdexcept>

#include "bench.hpp"

namespace sg::bench {
namespace {

enum : uint32_t { kStart = 1, kCtxReady, kPort, kReady, kWarm, kDone, kTorn, kQuit };

struct Msg {
    uint32_t type = 0;
    uint32_t arg = 0;
    uint64_t v[4] = {};
};

constexpr uint64_t kBlock = 64 << 10;   // 16 tokens x 4 KiB (fused K+V, 8 heads x 128 x fp16)
constexpr uint64_t kWaitNs = 60ull * 1000000000ull;

void check(sg_status_t s, const char *what, const sg_error_info_t *err = nullptr) {
    if (s == SG_OK) return;
    std::string detail = err && err->message[0] ? err->message : sg_last_error_message();
    throw std::runtime_error(std::string(what) + " failed: " + sg_status_str(s) + (detail.empty() ? "" : ": " + detail));
}

void check_wait(sg_status_t s, const char *what, sg_transfer_t x) {
    if (s == SG_OK) return;
    char msg[SG_ERROR_MESSAGE_MAX] = {};
    sg_status_t xs = SG_OK;
    if (x) sg_transfer_status(x, &xs, msg, sizeof msg);
    throw std::runtime_error(std::string(what) + " failed: " + sg_status_str(s) + (msg[0] ? std::string(": ") + msg : ""));
}

sg_context_t make_context(const std::string &provider, const std::vector<unsigned char> &key) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider.c_str();
    const char *file = getenv("SG_AUTH_KEY_FILE");
    if (!file || !*file) {
        o.auth_key = key.data();
        o.auth_key_len = key.size();
    }
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_context_t ctx = nullptr;
    check(sg_context_create(&o, &ctx, &err), "sg_context_create", &err);
    return ctx;
}

sg_kv_handle_t register_pool(sg_context_t ctx, void **base, uint64_t blocks) {
    sg_kv_layout_t layout;
    sg_kv_layout_init(&layout);
    layout.num_layers = 1;
    layout.num_kv_heads = 8;
    layout.head_dim = 128;
    layout.tokens_per_block = static_cast<uint32_t>(kBlock / 4096);
    layout.num_blocks = blocks;
    layout.dtype = SG_DTYPE_FP16;
    layout.packing = SG_KV_FUSED;
    layout.layer_k_base = base;
    layout.layer_base_count = 1;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_kv_handle_t kv = nullptr;
    check(sg_kv_register(ctx, &layout, &kv, &err), "sg_kv_register", &err);
    return kv;
}

std::vector<uint32_t> table_of(uint64_t blocks) {
    std::vector<uint32_t> t(blocks);
    for (uint64_t i = 0; i < blocks; ++i) t[i] = static_cast<uint32_t>(i);
    return t;
}

int run_child(Peer &peer, const std::string &provider, uint64_t bytes) {
    uint64_t blocks = bytes / kBlock;
    std::vector<unsigned char> mem(bytes, 0xA5);
    void *base = mem.data();
    auto table = table_of(blocks);
    for (;;) {
        Msg m;
        ctl_recv(peer.ctl, &m, sizeof m);
        if (m.type == kQuit) return 0;
        if (m.type != kStart) throw std::runtime_error("peer: expected START");
        uint32_t rep = m.arg;
        sg_context_t ctx = make_context(provider, peer.auth_key);
        Msg r{};
        r.type = kCtxReady;
        ctl_send(peer.ctl, &r, sizeof r);
        ctl_recv(peer.ctl, &m, sizeof m);
        sg_session_options_t so;
        sg_session_options_init(&so);
        sg_error_info_t err;
        sg_error_info_init(&err);
        sg_session_t session = nullptr;
        check(sg_session_connect(ctx, "127.0.0.1", static_cast<uint16_t>(m.v[0]), &so, 30000000000ull, &session, &err),
              "sg_session_connect", &err);
        sg_kv_handle_t kv = register_pool(ctx, &base, blocks);
        check(sg_session_export_kv(session, kv), "sg_session_export_kv");
        for (int i = 0; i < 2; ++i) {
            if (i == 1) {
                ctl_recv(peer.ctl, &m, sizeof m);
                if (m.type != kWarm) throw std::runtime_error("peer: expected WARM");
            }
            sg_transfer_options_t to;
            sg_transfer_options_init(&to);
            std::string rid = "cold" + std::to_string(rep) + "-" + std::to_string(i);
            sg_transfer_t x = nullptr;
            sg_error_info_init(&err);
            check(sg_transfer_expect(session, rid.c_str(), kv, table.data(), blocks, blocks * (kBlock / 4096), &to, &x, &err),
                  "sg_transfer_expect", &err);
            r = Msg{};
            r.type = kReady;
            ctl_send(peer.ctl, &r, sizeof r);
            check_wait(sg_transfer_wait(x, kWaitNs), "sg_transfer_wait (decode)", x);
            check(sg_transfer_release(x), "sg_transfer_release");
            r = Msg{};
            r.type = kDone;
            ctl_send(peer.ctl, &r, sizeof r);
        }
        ctl_recv(peer.ctl, &m, sizeof m);  // the prefill side released its transfer: tear down
        check(sg_kv_deregister(kv), "sg_kv_deregister");
        check(sg_session_destroy(session), "sg_session_destroy");
        check(sg_context_destroy(ctx), "sg_context_destroy");
        r = Msg{};
        r.type = kTorn;
        ctl_send(peer.ctl, &r, sizeof r);
    }
}

[[noreturn]] void bad_flag(const std::string &flag, const std::string &why) {
    std::fprintf(stderr, "smartgen-bench cold: %s: %s\n", flag.c_str(), why.c_str());
    std::exit(2);
}

double ms(uint64_t a, uint64_t b) { return static_cast<double>(b - a) / 1e6; }

}  // namespace

int run_cold(const Common &c) {
    Flags f("cold", c.rest);
    std::string provider = f.take("--provider").value_or("tcp");
    auto reps_s = f.take("--reps");
    auto bytes_s = f.take("--bytes");
    f.finish();
    if (provider == "tcp;ofi_rxm") provider = "tcp";
    if (provider != "tcp" && provider != "shm") bad_flag("--provider", "expected tcp or shm, got '" + provider + "'");
    int reps = c.quick ? 5 : 11;
    if (reps_s) {
        reps = std::atoi(reps_s->c_str());
        if (reps < 1 || reps > 1000) bad_flag("--reps", "1..1000");
    }
    uint64_t bytes = 1 << 20;
    if (bytes_s) {
        try {
            bytes = parse_bytes(*bytes_s);
        } catch (...) {
            bad_flag("--bytes", "not a size: '" + *bytes_s + "'");
        }
        if (bytes < kBlock || bytes % kBlock || bytes > (1ull << 30))
            bad_flag("--bytes", "a multiple of 64 KiB up to 1 GiB");
    }
    if (!c.plot.empty() && std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
        std::fprintf(stderr, "smartgen-bench cold: --plot needs gnuplot, which is not installed "
                             "(apt-get install gnuplot-nox; scripts/bench.sh installs it)\n");
        return 1;
    }

    Peer peer = fork_peer(false);
    if (peer.is_child) {
        int rc;
        try {
            rc = run_child(peer, provider, bytes);
        } catch (const std::exception &e) {
            std::fprintf(stderr, "smartgen-bench cold (peer): %s\n", e.what());
            rc = 1;
        }
        std::fflush(nullptr);
        _exit(rc);
    }

    const char *names[] = {"context create", "connect (listen+accept+auth)", "register+export", "wait for peer's expect",
                           "first transfer", "cold total", "warm transfer", "teardown"};
    constexpr int kPhases = 8;
    std::vector<double> t[kPhases];
    std::string session_provider = provider;
    uint64_t blocks = bytes / kBlock;
    std::vector<unsigned char> mem(bytes, 0x5A);
    void *base = mem.data();
    auto table = table_of(blocks);
    int rc = 0;
    try {
        progress("cold", std::to_string(reps) + " samples: fresh contexts, session, register, first " +
                             human_bytes(bytes) + " transfer; then a second one over the same session");
        for (int rep = 0; rep < reps; ++rep) {
            Msg m{};
            m.type = kStart;
            m.arg = static_cast<uint32_t>(rep);
            ctl_send(peer.ctl, &m, sizeof m);
            uint64_t a = now_ns();
            sg_context_t ctx = make_context(provider, peer.auth_key);
            uint64_t b = now_ns();
            sg_error_info_t err;
            sg_error_info_init(&err);
            sg_listener_t listener = nullptr;
            check(sg_listener_create(ctx, "127.0.0.1", 0, &listener, &err), "sg_listener_create", &err);
            uint16_t port = 0;
            check(sg_listener_port(listener, &port), "sg_listener_port");
            ctl_recv(peer.ctl, &m, sizeof m);  // the peer's context exists
            m = Msg{};
            m.type = kPort;
            m.v[0] = port;
            ctl_send(peer.ctl, &m, sizeof m);
            sg_session_options_t so;
            sg_session_options_init(&so);
            sg_session_t session = nullptr;
            sg_error_info_init(&err);
            check(sg_session_accept(listener, &so, 30000000000ull, &session, &err), "sg_session_accept", &err);
            uint64_t cc = now_ns();
            check(sg_listener_destroy(listener), "sg_listener_destroy");
            if (rep == 0) {
                char pname[64] = {};
                check(sg_session_provider(session, pname, sizeof pname), "sg_session_provider");
                session_provider = pname;
            }
            uint64_t d0 = now_ns();
            sg_kv_handle_t kv = register_pool(ctx, &base, blocks);
            check(sg_session_export_kv(session, kv), "sg_session_export_kv");
            uint64_t d = now_ns();
            uint64_t xfer_ns[2] = {}, ready_ns = 0, end_cold = 0;
            for (int i = 0; i < 2; ++i) {
                uint64_t w0 = now_ns();
                if (i == 1) {
                    m = Msg{};
                    m.type = kWarm;
                    ctl_send(peer.ctl, &m, sizeof m);
                }
                ctl_recv(peer.ctl, &m, sizeof m);  // READY: the peer expects
                uint64_t e = now_ns();
                if (i == 0) ready_ns = e - w0;
                sg_transfer_options_t to;
                sg_transfer_options_init(&to);
                to.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
                std::string rid = "cold" + std::to_string(rep) + "-" + std::to_string(i);
                sg_transfer_t x = nullptr;
                sg_error_info_init(&err);
                check(sg_transfer_post(session, rid.c_str(), kv, table.data(), blocks, blocks * (kBlock / 4096), &to, &x,
                                       &err),
                      "sg_transfer_post", &err);
                check_wait(sg_transfer_wait(x, kWaitNs), "sg_transfer_wait (prefill)", x);
                uint64_t g = now_ns();
                xfer_ns[i] = g - e;
                if (i == 0) end_cold = g;
                ctl_recv(peer.ctl, &m, sizeof m);  // DONE
                check(sg_transfer_release(x), "sg_transfer_release");
            }
            uint64_t h0 = now_ns();
            m = Msg{};
            m.type = kDone;
            ctl_send(peer.ctl, &m, sizeof m);
            check(sg_kv_deregister(kv), "sg_kv_deregister");
            check(sg_session_destroy(session), "sg_session_destroy");
            check(sg_context_destroy(ctx), "sg_context_destroy");
            ctl_recv(peer.ctl, &m, sizeof m);  // TORN
            uint64_t h = now_ns();
            t[0].push_back(ms(a, b));
            t[1].push_back(ms(b, cc));
            t[2].push_back(ms(d0, d));
            t[3].push_back(static_cast<double>(ready_ns) / 1e6);
            t[4].push_back(static_cast<double>(xfer_ns[0]) / 1e6);
            t[5].push_back(ms(a, end_cold));
            t[6].push_back(static_cast<double>(xfer_ns[1]) / 1e6);
            t[7].push_back(ms(h0, h));
            char buf[200];
            std::snprintf(buf, sizeof buf, "[%d/%d] cold %.2f ms (context %.2f, connect %.2f, register %.2f, first %.2f), warm %.3f ms",
                          rep + 1, reps, t[5].back(), t[0].back(), t[1].back(), t[2].back(), t[4].back(), t[6].back());
            progress("cold", buf);
        }
        Msg m{};
        m.type = kQuit;
        ctl_send(peer.ctl, &m, sizeof m);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "smartgen-bench cold: %s\n", e.what());
        rc = 1;
    }
    rc = finish_peer("cold", peer, rc, 60);
    if (rc) return rc;

    Report report(c);
    double warm = median(t[6]);
    for (int i = 0; i < kPhases; ++i) {
        Line l;
        l.bench = "cold";
        l.value = median(t[i]);
        l.unit = "ms";
        l.provider = session_provider;
        l.op = "write";
        l.pattern = "contiguous";
        l.block_bytes = kBlock;
        l.queue_depth = 1;
        l.total_bytes = bytes;
        l.link = "loopback";
        l.extra_text["phase"] = names[i];
        l.extra["p10_ms"] = percentile(t[i], 10);
        l.extra["p90_ms"] = percentile(t[i], 90);
        l.extra["phase_index"] = i;
        l.extra["samples"] = static_cast<double>(t[i].size());
        if (i == 4 || i == 5) {
            // Lower is better: ratio = baseline / value, so the cold/warm factor is 1 / ratio.
            l.baseline_name = "warm transfer";
            l.baseline_value = warm;
            l.ratio = warm / l.value;
            l.extra["cold_over_warm"] = l.value / warm;
            char buf[160];
            std::snprintf(buf, sizeof buf, "%s: %.1fx a warm transfer of the same %s (median of %d)", names[i],
                          l.value / warm, human_bytes(bytes).c_str(), reps);
            l.note = buf;
        } else if (i == 2) {
            l.note = "memory is registered with the fabric lazily, at the first transfer of the session";
        }
        report.add(l);
    }
    report.print_table();
    if (!c.plot.empty()) {
        report.plot("smartgen-bench cold: phases of a first " + human_bytes(bytes) + " transfer (" + session_provider + ")",
                    "phase (0 context, 1 connect, 2 register, 3 peer expect, 4 first transfer, 5 cold total, 6 warm, 7 teardown)",
                    "ms (median)", [](const Line &l) { return l.extra.at("phase_index"); },
                    [](const Line &) { return std::string("median"); });
        progress("cold", "plot written to " + c.plot);
    }
    return 0;
}

}  // namespace sg::bench
