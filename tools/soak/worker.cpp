// A worker process: one context (and pools, and on the decode side a listener) per session it holds;
// warm-up against an in-process partner, the baseline, one thread per session, the end sample.
//
// Lines to the orchestrator (stdout): BASE/END <rss> <fds> <registrations>; PORT <s> <port> (decode);
// UP <s> <gen> <next>; RUNNING (every session up); LOST <s> <gen>; DONE <s>; T/E (session.hpp);
// X <s> <detail> for an unexpected failure outside a transfer. Lines from it (stdin): PORT <s> <port>
// <decode incarnation>; DOOMED <decode proc> <incarnation> (sent before that process is killed).
#include "session.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace soak {

namespace {

std::mutex out_mu;
void emit_line(const std::string &line) {
    std::string l = line + "\n";
    std::lock_guard<std::mutex> g(out_mu);
    const char *p = l.data();
    size_t left = l.size();
    while (left) {
        ssize_t w = ::write(1, p, left);
        if (w <= 0) return;  // the orchestrator is gone; nothing left to tell
        p += w, left -= size_t(w);
    }
}

// What the orchestrator told this (prefill) process about its peers' listeners.
struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    std::map<int, std::pair<uint16_t, int>> port;  // session -> (port, decode incarnation)
    std::map<int, int> doomed;                     // decode proc -> highest incarnation about to die
    bool finish = false;                           // no kill will come: sessions at their target may close
};
Mailbox mailbox;

void read_control() {
    std::string buf;
    char chunk[4096];
    for (;;) {
        ssize_t r = ::read(0, chunk, sizeof chunk);
        if (r <= 0) return;
        buf.append(chunk, size_t(r));
        size_t nl;
        while ((nl = buf.find('\n')) != std::string::npos) {
            std::string line = buf.substr(0, nl);
            buf.erase(0, nl + 1);
            int s = 0, port = 0, inc = 0;
            std::lock_guard<std::mutex> g(mailbox.mu);
            if (std::sscanf(line.c_str(), "PORT %d %d %d", &s, &port, &inc) == 3)
                mailbox.port[s] = {uint16_t(port), inc};
            else if (std::sscanf(line.c_str(), "DOOMED %d %d", &s, &inc) == 2)
                mailbox.doomed[s] = std::max(mailbox.doomed[s], inc);
            else if (line == "FINISH")
                mailbox.finish = true;
            mailbox.cv.notify_all();
        }
    }
}

const char *session_provider(const char *p) { return std::strcmp(p, "tcp") == 0 ? "tcp;ofi_rxm" : "shm"; }

std::string res_line(const char *tag, const Resources &r) {
    char b[128];
    std::snprintf(b, sizeof b, "%s %llu %llu %llu %llu", tag, (unsigned long long)r.rss, (unsigned long long)r.fds,
                  (unsigned long long)r.registrations, (unsigned long long)r.kept_fds_allowed);
    return b;
}

struct Local {
    int session = -1;
    const char *provider = nullptr;
    sg_context_t ctx = nullptr;
    std::vector<Pool> pools;
    sg_listener_t listener = nullptr;
    uint16_t port = 0;
};

// One side of a session made with accept (decode) or connect (prefill), run to `target` and closed.
void run_pair_side(const Config &cfg, bool prefill, std::vector<Pool> &pools, uint64_t skey, sg_context_t ctx,
                   sg_listener_t listener, uint16_t port, const char *provider, uint64_t target) {
    sg_session_options_t so;
    sg_session_options_init(&so);
    so.provider = session_provider(provider);
    sg_session_t sess = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    const uint64_t wait = uint64_t(cfg.wait_s) * kSecond;
    sg_status_t st = prefill ? sg_session_connect(ctx, "127.0.0.1", port, &so, wait, &sess, &err)
                             : sg_session_accept(listener, &so, wait, &sess, &err);
    if (st != SG_OK) {
        emit_line(std::string("X -1 warm-up ") + (prefill ? "connect: " : "accept: ") + sg_status_str(st) + ": " +
                  err.message);
        return;
    }
    SideRunner r(cfg, prefill, pools, skey, -1, emit_line);
    r.set_loss_expected(false);
    uint64_t n = 0;
    std::string why;
    if (!r.hello(sess, n, &why)) {
        emit_line("X -1 warm-up hello: " + why);
    } else if (SideRunner::End e = r.run(sess, n, target); e != SideRunner::End::Done) {
        char detail[256] = "";
        sg_status_t se = SG_OK;
        sg_session_error(sess, &se, detail, sizeof detail);
        emit_line(std::string("X -1 warm-up ") + (prefill ? "prefill" : "decode") + " session ended early at " +
                  std::to_string(n) + (e == SideRunner::End::Lost ? " (lost): " : " (failed): ") +
                  sg_status_str(se) + ": " + detail);
    } else if ((st = r.finish_handshake()) != SG_OK) {
        emit_line(std::string("X -1 warm-up finish handshake: ") + sg_status_str(st));
    } else if ((st = sg_session_close(sess, wait)) != SG_OK) {
        emit_line(std::string("X -1 warm-up sg_session_close: ") + sg_status_str(st));
    }
    sg_session_destroy(sess);
}

// Warm-up: every context runs `warmup` transfers in its own role against an in-process partner
// context of the same provider, then the session closes and the partner goes. What the baseline
// then holds is what any later idle moment should hold.
bool warm_up(const Config &cfg, bool prefill, std::vector<Local> &locals) {
    if (cfg.warmup <= 0) return true;
    struct Partner {
        sg_context_t ctx = nullptr;
        std::vector<Pool> pools;
        sg_listener_t listener = nullptr;
        uint16_t port = 0;
    };
    std::map<std::string, Partner> partners;
    bool ok = true;
    for (size_t i = 0; i < locals.size() && ok; ++i) {
        Local &L = locals[i];
        Partner &P = partners[L.provider];
        if (!P.ctx) {
            P.ctx = make_context(L.provider, "warm-up partner");
            if (!P.ctx || !make_pools(P.ctx, !prefill, P.pools)) return false;
            if (prefill) {  // the partner is the decode side: it listens
                if (sg_listener_create(P.ctx, "127.0.0.1", 0, &P.listener, nullptr) != SG_OK) return false;
                sg_listener_port(P.listener, &P.port);
            }
        }
        uint64_t skey = mix(0x5741524dull, uint64_t(prefill), uint64_t(cfg.index), uint64_t(cfg.incarnation) * 4096 + i);
        sg_listener_t lst = prefill ? P.listener : L.listener;
        uint16_t port = prefill ? P.port : L.port;
        std::thread partner([&] {
            run_pair_side(cfg, !prefill, P.pools, skey, P.ctx, lst, port, L.provider, uint64_t(cfg.warmup));
        });
        run_pair_side(cfg, prefill, L.pools, skey, L.ctx, lst, port, L.provider, uint64_t(cfg.warmup));
        partner.join();
    }
    for (auto &kv : partners) {
        sg_listener_destroy(kv.second.listener);
        destroy_pools(kv.second.pools);
        sg_context_destroy(kv.second.ctx);
    }
    return ok;
}

std::atomic<int> sessions_up{0};

void main_session(const Config &cfg, bool prefill, Local &L, int total_local) {
    const int s = L.session;
    const int dproc = decode_proc_of(cfg, s);
    const uint64_t wait = uint64_t(cfg.wait_s) * kSecond;
    SideRunner r(cfg, prefill, L.pools, uint64_t(s), s, emit_line);
    sg_session_options_t so;
    sg_session_options_init(&so);
    so.provider = session_provider(L.provider);
    uint64_t next_n = 0;
    int gen = 0, failures = 0, used_inc = -1;
    uint16_t used_port = 0;
    bool counted = false;
    const uint64_t target = uint64_t(cfg.transfers);
    for (;;) {  // until DONE: a session parked at its target that loses its peer reconnects too
        if (failures > 3) {
            emit_line("X " + std::to_string(s) + " gave up on the session after 4 failed attempts");
            return;
        }
        sg_session_t sess = nullptr;
        sg_error_info_t err;
        sg_error_info_init(&err);
        sg_status_t st;
        if (prefill) {
            // After a loss: if our decode peer was about to be killed, wait for its successor's port;
            // otherwise the listener is still there and we reconnect to it.
            std::unique_lock<std::mutex> g(mailbox.mu);
            auto ready = [&] {
                auto it = mailbox.port.find(s);
                if (it == mailbox.port.end()) return false;
                if (used_inc < 0) return true;
                if (it->second.second > used_inc) return true;
                auto d = mailbox.doomed.find(dproc);
                return d == mailbox.doomed.end() || d->second < used_inc;
            };
            if (!mailbox.cv.wait_for(g, std::chrono::seconds(2 * cfg.wait_s), ready)) {
                emit_line("X " + std::to_string(s) + " no listener port from the orchestrator");
                ++failures;
                continue;
            }
            used_port = mailbox.port[s].first;
            used_inc = mailbox.port[s].second;
            g.unlock();
            st = sg_session_connect(L.ctx, "127.0.0.1", used_port, &so, wait, &sess, &err);
        } else {
            st = sg_session_accept(L.listener, &so, wait, &sess, &err);
        }
        if (st != SG_OK) {
            emit_line("X " + std::to_string(s) + (prefill ? " sg_session_connect: " : " sg_session_accept: ") +
                      sg_status_str(st) + ": " + err.message);
            ++failures;
            sleep_ms(100);
            continue;
        }
        std::string why;
        if (!r.hello(sess, next_n, &why)) {
            emit_line("X " + std::to_string(s) + " hello: " + why);
            sg_session_destroy(sess);
            ++failures;
            continue;
        }
        failures = 0;
        emit_line("UP " + std::to_string(s) + " " + std::to_string(gen) + " " + std::to_string(next_n));
        if (!counted) {
            counted = true;
            if (++sessions_up == total_local) emit_line("RUNNING");
        }
        SideRunner::End end = r.run(sess, next_n, target);
        if (end == SideRunner::End::Done) {
            // Parked at the target until the orchestrator has made its last kill (a kill now still
            // finds this session up and is survived like any other), then both sides agree to close.
            sg_status_t se = SG_OK;
            for (;;) {
                {
                    std::lock_guard<std::mutex> g(mailbox.mu);
                    if (mailbox.finish) break;
                }
                if ((se = r.health()) != SG_OK) break;
                sleep_ms(20);
            }
            if (se == SG_OK) se = r.finish_handshake();
            if (se == SG_OK) {
                st = sg_session_close(sess, wait);
                if (st != SG_OK) emit_line("X " + std::to_string(s) + " sg_session_close: " + sg_status_str(st));
                sg_session_destroy(sess);
                emit_line("DONE " + std::to_string(s));
                return;
            }
            end = se == SG_ERR_PEER_LOST ? SideRunner::End::Lost : SideRunner::End::Broken;
        }
        char detail[256] = "";
        sg_status_t se = SG_OK;
        sg_session_error(sess, &se, detail, sizeof detail);
        if (end == SideRunner::End::Broken)
            emit_line("X " + std::to_string(s) + " session failed: " + sg_status_str(se) + ": " + detail);
        else
            emit_line("LOST " + std::to_string(s) + " " + std::to_string(gen));
        sg_session_destroy(sess);
        ++gen;
    }
}

}  // namespace

int run_worker(const Config &cfg) {
    const bool prefill = cfg.role == "prefill";
    if (!prefill && cfg.role != "decode") {
        std::fprintf(stderr, "smartgen-soak: --worker prefill|decode\n");
        return 2;
    }
    std::thread(read_control).detach();
    // The busy host: threads that never yield, at the runtime's own priority. They end with the process.
    for (int i = 0; i < cfg.hog_threads; ++i)
        std::thread([] {
            volatile uint64_t spin = 0;
            for (;;) spin = spin + 1;
        }).detach();
    std::vector<Local> locals;
    for (int s : sessions_of(cfg, prefill, cfg.index)) {
        locals.emplace_back();
        locals.back().session = s;
        locals.back().provider = provider_of(cfg, s);
    }
    std::vector<sg_context_t> ctxs;
    for (Local &L : locals) {
        std::string tag = cfg.role + std::to_string(cfg.index) + "." + std::to_string(cfg.incarnation) + " s" +
                          std::to_string(L.session) + " " + L.provider;
        L.ctx = make_context(L.provider, tag);
        if (!L.ctx || !make_pools(L.ctx, prefill, L.pools)) return 3;
        ctxs.push_back(L.ctx);
        if (!prefill) {
            sg_error_info_t err;
            sg_error_info_init(&err);
            if (sg_listener_create(L.ctx, "127.0.0.1", 0, &L.listener, &err) != SG_OK) {
                std::fprintf(stderr, "smartgen-soak: sg_listener_create: %s\n", err.message);
                return 3;
            }
            sg_listener_port(L.listener, &L.port);
        }
    }
    if (!warm_up(cfg, prefill, locals)) return 4;
    sleep_ms(500);  // let connections to the destroyed warm-up partners wind down before the baseline
    const Resources base = sample(ctxs);
    const auto base_fds = fd_table();
    emit_line(res_line("BASE", base));
    if (!prefill)
        for (Local &L : locals) emit_line("PORT " + std::to_string(L.session) + " " + std::to_string(L.port));

    std::vector<std::thread> threads;
    for (Local &L : locals) threads.emplace_back(main_session, std::cref(cfg), prefill, std::ref(L), int(locals.size()));
    for (auto &t : threads) t.join();

    // Each tcp context may keep one connection per lane to its live peer context (finding 2).
    uint64_t kept_fds_allowed = 0;
    for (Local &L : locals) {
        sg_context_stats_t st;
        sg_context_stats_init(&st);
        if (std::strcmp(L.provider, "tcp") == 0 && sg_context_stats(L.ctx, &st) == SG_OK) kept_fds_allowed += st.lanes;
    }
    // The connections of a session lost to a killed peer close on the provider's progress, which may
    // come after the session's last call returned (under ASan, a fresh-clone CI run sampled one such
    // socket still open): give them a few seconds before the end is sampled. A descriptor that
    // leaked stays, and fails the run as before.
    Resources end = sample(ctxs);
    const uint64_t settle_start = now_ns();
    while (end.fds > base.fds + kept_fds_allowed && now_ns() - settle_start < 5'000'000'000ull) {
        sleep_ms(100);
        end = sample(ctxs);
    }
    if (now_ns() - settle_start > 50'000'000ull)
        emit_line("INFO descriptors took " + std::to_string((now_ns() - settle_start) / 1'000'000) +
                  " ms to come back within the allowance (" + std::to_string(end.fds) + " at the end, baseline " +
                  std::to_string(base.fds) + " + " + std::to_string(kept_fds_allowed) + ")");
    end.kept_fds_allowed = kept_fds_allowed;
    if (end.fds != base.fds) {  // name what differs, for the report
        const auto end_fds = fd_table();
        for (auto &f : end_fds)
            if (std::find(base_fds.begin(), base_fds.end(), f) == base_fds.end())
                emit_line("INFO descriptor opened since the baseline: " + std::to_string(f.first) + " -> " + f.second);
        for (auto &f : base_fds)
            if (std::find(end_fds.begin(), end_fds.end(), f) == end_fds.end())
                emit_line("INFO descriptor closed since the baseline: " + std::to_string(f.first) + " -> " + f.second);
    }
    emit_line(res_line("END", end));
    // What the runtime's own end-to-end verification checked (SG_TRANSFER_VERIFY=1, --verify).
    uint64_t blocks_verified = 0, mismatches = 0;
    for (Local &L : locals) {
        sg_context_stats_t st;
        sg_context_stats_init(&st);
        if (sg_context_stats(L.ctx, &st) != SG_OK) continue;
        blocks_verified += st.blocks_verified;
        mismatches += st.verify_mismatches;
    }
    emit_line("VERIFY " + std::to_string(blocks_verified) + " " + std::to_string(mismatches));
    for (Local &L : locals) {
        sg_listener_destroy(L.listener);
        destroy_pools(L.pools);
        sg_context_destroy(L.ctx);
    }
    return 0;
}

}  // namespace soak
