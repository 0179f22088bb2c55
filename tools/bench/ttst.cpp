// smartgen-bench ttst: time to second token, selective (SmartGen) against full transfer, and the
// on-demand fetch latency under a saturating speculative transfer (P4, P7).
//
// The sweep runs examples/disagg's smartgen-disagg in its emulation (--emulate MODEL --emulate-tokens
// N --json: a real fp16 KV cache of the model's shape crosses the link, the compute is modelled) as
// child processes, three ways per point, alternated: full posted after prefill, full streamed layer
// by layer, and SmartGen selective (proactive + on-demand + speculative) at each budget. Over
// loopback (tcp;ofi_rxm on 127.0.0.1, default) or, with --link RATE, between two network namespaces
// joined by a tbf-shaped veth pair (scripts/netns-link.sh, scripts/netns-disagg.sh, root), where
// iperf3 measures the raw TCP rate of the link before every run.
//
// P4 = stall(full streamed) / stall(SmartGen), Llama-3-8B at budget 1/8 (target >= 10 over the
// 10 Gbit/s link). P7 = median on-demand fetch latency while a speculative transfer saturates the
// link / the same fetches on an idle link (target <= 2); measured here directly with the public C
// API between two forked processes over tcp;ofi_rxm (in the two namespaces with --link).
//
// Lines: one per (model, tokens, way) with value = TTST (ms), baseline = full streamed's TTST, ratio =
// baseline / value, and TTFT, stall, TPOT, time until the cache is complete (smartgen-disagg does not
// report it: full = TTST, an upper bound; selective = TTST + (sparse steps - 1) x TPOT + decode's wait
// for the rest, an estimate), bytes per path, the digests, their total (`bytes`) and that total over the
// whole KV (`bytes_of_kv`), and on-demand waits in `extra`; a "P4" line per prompt
// length (Llama-3-8B, budget 1/8) with value = SmartGen's stall, baseline = full streamed's stall; one
// "P7" line with value = median fetch latency during the bulk, baseline = the idle median. Every run
// generates 256 tokens; beside P4, "P10" lines compare the whole response (t0 -> token 64, t0 -> token
// 256) and a "P11" line the time per token with full streamed's, each with the median of the runs and
// the worst run's ratio (the slowest SmartGen run against the fastest streamed one).
//
// Flags: --link loopback|10gbit|5gbit|1gbit (tbf, latency 1 ms; root), --models LIST (llama3-8b,
// qwen3-8b, llama3-70b), --tokens LIST, --budgets LIST (1/4,1/8,1/16), --runs N (8; --quick 1),
// --provider NAME (loopback only; tcp), --disagg PATH (or SMARTGEN_DISAGG), --iperf-seconds S (2),
// --p7-bytes B (1G; --quick 512M), --p7-reps N (5; --quick 2), --p7-gap-us US (15000),
// --p7-session-inflight B and --p7-max-op B (prefill-side experiment knobs), --no-p7, --p7-only,
// --selective-args="ARGS" (smartgen-disagg flags added to the selective rows only, for ablations;
// the = form, since ARGS start with --).
// --quick: Llama-3-8B, 8K tokens, budget 1/8, one run each, P7 with 512 MiB (about 10 s here).
// The full sweep (8 points x 5 ways x 3 runs: tens of minutes per link, longer at 1gbit, on two shared
// cores): sudo smartgen-bench ttst --link 10gbit, then
// --link 5gbit, --link 1gbit, and without --link for loopback.
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <smartgen/smartgen.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"

#ifndef SMARTGEN_DISAGG_BINARY
#define SMARTGEN_DISAGG_BINARY ""
#endif
#ifndef SMARTGEN_SOURCE_DIR
#define SMARTGEN_SOURCE_DIR "."
#endif

namespace sg::bench {
namespace {

constexpr const char *kBench = "ttst";
constexpr uint64_t kSecond = 1000000000ull;

std::string fmt(const char *f, double a) {
    char b[64];
    std::snprintf(b, sizeof b, f, a);
    return b;
}

std::vector<std::string> split(const std::string &s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, sep))
        if (!item.empty()) out.push_back(item);
    return out;
}

[[noreturn]] void bad_flag(const std::string &flag, const std::string &why) {
    std::fprintf(stderr, "smartgen-bench ttst: %s: %s\n", flag.c_str(), why.c_str());
    std::exit(2);
}

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------
struct ChildResult {
    int rc = -1;
    std::string out, err;
};

// Runs argv with extra environment entries; stdout through a pipe, stderr into a temporary file.
ChildResult run_child(const std::vector<std::string> &argv, const std::vector<std::string> &env) {
    ChildResult r;
    char err_path[] = "/tmp/smartgen-bench-ttst-XXXXXX";
    const int err_fd = mkstemp(err_path);
    if (err_fd < 0) throw std::runtime_error("mkstemp failed");
    unlink(err_path);
    int p[2];
    if (pipe(p) != 0) throw std::runtime_error("pipe failed");
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(err_fd, 2);
        close(p[0]);
        close(p[1]);
        close(err_fd);
        for (const auto &e : env) putenv(strdup(e.c_str()));
        std::vector<char *> a;
        for (const auto &s : argv) a.push_back(const_cast<char *>(s.c_str()));
        a.push_back(nullptr);
        execvp(a[0], a.data());
        std::fprintf(stderr, "exec %s: %s\n", a[0], std::strerror(errno));
        _exit(127);
    }
    close(p[1]);
    char buf[65536];
    ssize_t n;
    while ((n = read(p[0], buf, sizeof buf)) > 0) r.out.append(buf, size_t(n));
    close(p[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    lseek(err_fd, 0, SEEK_SET);
    while ((n = read(err_fd, buf, sizeof buf)) > 0) r.err.append(buf, size_t(n));
    close(err_fd);
    return r;
}

// ---------------------------------------------------------------------------------------------
// Raw TCP over loopback: the rate the "link" carries when there is no shaped link (one stream,
// 1 MiB send() calls, one-byte acknowledgement), between two processes.
// ---------------------------------------------------------------------------------------------
double loopback_tcp_bps(uint64_t bytes) {
    const int ls = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (ls < 0 || bind(ls, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, reinterpret_cast<sockaddr *>(&a), &alen) != 0)
        return NAN;
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
        const int s = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) _exit(1);
        std::vector<char> buf(1 << 20);
        uint64_t got = 0;
        ssize_t n;
        while (got < bytes && (n = recv(s, buf.data(), buf.size(), 0)) > 0) got += uint64_t(n);
        char ack = 1;
        if (send(s, &ack, 1, 0) != 1) _exit(1);
        close(s);
        _exit(0);
    }
    const int s = accept(ls, nullptr, nullptr);
    close(ls);
    std::vector<char> buf(1 << 20, 7);
    const uint64_t t0 = now_ns();
    uint64_t sent = 0;
    while (sent < bytes) {
        const ssize_t n = send(s, buf.data(), std::min<uint64_t>(buf.size(), bytes - sent), 0);
        if (n <= 0) break;
        sent += uint64_t(n);
    }
    char ack = 0;
    const bool ok = recv(s, &ack, 1, MSG_WAITALL) == 1;
    const uint64_t t1 = now_ns();
    close(s);
    int st = 0;
    waitpid(pid, &st, 0);
    return ok ? double(bytes) * 8.0 / (double(t1 - t0) / 1e9) : NAN;
}

// ---------------------------------------------------------------------------------------------
// The sweep
// ---------------------------------------------------------------------------------------------
struct Point {
    std::string model;
    uint64_t tokens;
};

struct Config {
    std::string label;  // "full-after", "full-streamed", "selective"
    double budget = 0;  // selective only
    std::vector<std::string> args;
};

struct Run {
    double ttft = NAN, ttst = NAN, stall = NAN, tpot = NAN, complete = NAN;
    double bytes_full = 0, bytes_proactive = 0, bytes_on_demand = 0, bytes_speculative = 0, digest = 0, bytes = 0;
    double fetch_calls = 0, fetch_wait_ms = 0, first_wait_ms = 0, sparse_steps = 0, essential_wait_ms = NAN,
           selector_ms = NAN, proactive_fraction = NAN, attended_fraction = NAN;
    // The stall's parts (selective): token 1's arrival at decode, step 2's selector and on-demand
    // wait, and the stall with step 2's selection modelled on the accelerator (emulation).
    double stall_first_message_ms = NAN, stall_selector_ms = NAN, stall_fetch_wait_ms = NAN, stall_fetch_calls = NAN,
           stall_modelled_sel_ms = NAN;
    double tcp_bps = NAN, nominal_bps = NAN, qdisc_bytes = NAN;
    // The whole response (smartgen-disagg runs 256 new tokens here): t0 -> the 64th and -> the 256th
    // token, and the time per token after the second of the steps that attended sparse and of those
    // that attended whole.
    double e2e64 = NAN, e2e256 = NAN, tpot_sparse = NAN, tpot_dense = NAN;
    std::string provider;
};

double num_or_nan(const nlohmann::json &j, const char *k) {
    auto it = j.find(k);
    return it != j.end() && it->is_number() ? it->get<double>() : NAN;
}

Run parse_run(const std::string &out) {
    // The JSON object is the last line that starts with '{'.
    std::string line;
    for (const auto &l : split(out, '\n'))
        if (!l.empty() && l[0] == '{') line = l;
    if (line.empty()) throw std::runtime_error("no JSON object in smartgen-disagg's output");
    const auto j = nlohmann::json::parse(line);
    Run r;
    r.ttft = num_or_nan(j, "ttft_ms");
    r.ttst = num_or_nan(j, "ttst_ms");
    r.stall = num_or_nan(j, "stall_ms");
    r.tpot = num_or_nan(j, "tpot_ms");
    r.bytes = num_or_nan(j, "bytes");
    r.bytes_full = num_or_nan(j, "bytes_full");
    r.bytes_proactive = num_or_nan(j, "bytes_proactive");
    r.bytes_on_demand = num_or_nan(j, "bytes_on_demand");
    r.bytes_speculative = num_or_nan(j, "bytes_speculative");
    r.digest = num_or_nan(j, "digest_bytes");
    r.first_wait_ms = num_or_nan(j, "first_step_wait_ms");
    r.e2e64 = num_or_nan(j, "e2e_64_ms");
    r.e2e256 = num_or_nan(j, "e2e_ms");
    r.tpot_sparse = num_or_nan(j, "tpot_sparse_ms");
    r.tpot_dense = num_or_nan(j, "tpot_dense_ms");
    r.provider = j.value("provider", "");
    if (j.value("mode", "") == "selective") {
        r.fetch_calls = num_or_nan(j, "fetch_calls");
        r.fetch_wait_ms = num_or_nan(j, "fetch_wait_ms");
        r.sparse_steps = num_or_nan(j, "sparse_steps");
        r.essential_wait_ms = num_or_nan(j, "essential_wait_ms");
        r.selector_ms = num_or_nan(j, "selector_ms");
        r.proactive_fraction = num_or_nan(j, "proactive_fraction");
        r.attended_fraction = num_or_nan(j, "attended_fraction");
        r.stall_first_message_ms = num_or_nan(j, "stall_first_message_ms");
        r.stall_selector_ms = num_or_nan(j, "stall_selector_ms");
        r.stall_fetch_wait_ms = num_or_nan(j, "stall_fetch_wait_ms");
        r.stall_fetch_calls = num_or_nan(j, "stall_fetch_calls");
        r.stall_modelled_sel_ms = num_or_nan(j, "stall_modelled_selection_ms");
        // smartgen-disagg does not report when the cache became complete. Estimate: the decode side
        // runs sparse steps until sg_transfer_test says complete, then waits for the rest
        // (complete_wait_ms, when it stopped early): TTST + (sparse steps - 1) x TPOT + that wait.
        const double cw = num_or_nan(j, "complete_wait_ms");
        r.complete = r.ttst + std::max(0.0, r.sparse_steps - 1) * r.tpot + (std::isfinite(cw) ? cw : 0);
    } else {
        // Full: decode's step 2 waits for every layer before it needs it, so the cache is complete
        // before the second token: TTST is an upper bound.
        r.complete = r.ttst;
    }
    if (auto it = j.find("link"); it != j.end() && it->is_object()) {
        r.tcp_bps = num_or_nan(*it, "tcp_bps");
        r.nominal_bps = num_or_nan(*it, "nominal_bps");
        if (auto q = it->find("qdisc_prefill_end"); q != it->end() && q->is_object())
            r.qdisc_bytes = num_or_nan(*q, "sent_bytes");
    }
    return r;
}

uint64_t kv_bytes(const std::string &model, uint64_t tokens) {
    const uint64_t layers = model == "llama3-70b" ? 80 : model == "qwen3-8b" ? 36 : 32;
    return layers * 2 * 8 * 128 * 2 * tokens;  // K and V, 8 KV heads, head_dim 128, fp16
}

double med(const std::vector<Run> &rs, double Run::*f) {
    std::vector<double> v;
    for (const auto &r : rs)
        if (std::isfinite(r.*f)) v.push_back(r.*f);
    return v.empty() ? NAN : median(v);
}
double lo(const std::vector<Run> &rs, double Run::*f) {
    double m = INFINITY;
    for (const auto &r : rs)
        if (std::isfinite(r.*f)) m = std::min(m, r.*f);
    return m;
}
double hi(const std::vector<Run> &rs, double Run::*f) {
    double m = -INFINITY;
    for (const auto &r : rs)
        if (std::isfinite(r.*f)) m = std::max(m, r.*f);
    return m;
}

std::string budget_label(double b) {
    const double inv = 1.0 / b;
    if (std::fabs(inv - std::round(inv)) < 1e-9) return "1/" + std::to_string(int(std::round(inv)));
    return fmt("%g", b);
}

// ---------------------------------------------------------------------------------------------
// P7: on-demand fetches during a speculative bulk transfer vs on an idle link, C API, two processes
// ---------------------------------------------------------------------------------------------
struct P7Result {
    std::vector<double> idle_ms, busy_ms;
    std::vector<double> bulk_gbps;        // payload rate of each speculative transfer with fetches (decode side)
    std::vector<double> bulk_alone_gbps;  // the same transfer without fetches
    std::string provider;
};

constexpr uint32_t kP7Layers = 32, kP7Heads = 8, kP7Dim = 128, kP7Tpb = 16;  // 64 KiB blocks (K + V)
constexpr uint64_t kP7BlockBytes = 2ull * kP7Tpb * kP7Heads * kP7Dim * 2;

struct P7Pool {
    std::vector<std::vector<uint8_t>> k, v;
    std::vector<void *> kp, vp;
    sg_kv_layout_t layout{};
    sg_kv_handle_t kv = nullptr;
};

bool p7_pool(sg_context_t ctx, uint32_t nb, uint8_t fill, P7Pool &p) {
    const size_t plane = size_t(kP7Tpb) * kP7Heads * kP7Dim * 2;
    p.k.assign(kP7Layers, std::vector<uint8_t>(plane * nb, fill));
    p.v.assign(kP7Layers, std::vector<uint8_t>(plane * nb, fill));
    for (uint32_t l = 0; l < kP7Layers; ++l) {
        p.kp.push_back(p.k[l].data());
        p.vp.push_back(p.v[l].data());
    }
    sg_kv_layout_init(&p.layout);
    p.layout.num_layers = kP7Layers;
    p.layout.num_kv_heads = kP7Heads;
    p.layout.head_dim = kP7Dim;
    p.layout.tokens_per_block = kP7Tpb;
    p.layout.num_blocks = nb;
    p.layout.dtype = SG_DTYPE_FP16;
    p.layout.layer_k_base = p.kp.data();
    p.layout.layer_v_base = p.vp.data();
    p.layout.layer_base_count = kP7Layers;
    return sg_kv_register(ctx, &p.layout, &p.kv, nullptr) == SG_OK;
}

// Experiment knobs for the prefill side (0 = the library's default): the session's RMA payload in
// flight and the largest RMA operation.
struct P7Knobs {
    uint64_t session_inflight = 0, max_op = 0;
};

sg_context_t p7_context(const std::vector<uint8_t> &key, const char *local_addr, const P7Knobs &k = {}) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "tcp";
    o.local_addr = local_addr;
    if (k.session_inflight) o.max_session_bytes_in_flight = k.session_inflight;
    o.auth_key = key.data();
    o.auth_key_len = key.size();
    sg_context_t ctx = nullptr;
    if (sg_context_create(&o, &ctx, nullptr) != SG_OK) return nullptr;
    if (k.max_op && sg_context_set_param(ctx, SG_PARAM_MAX_OP_BYTES, k.max_op) != SG_OK) {
        sg_context_destroy(ctx);
        return nullptr;
    }
    return ctx;
}

bool next_note(sg_session_t s, std::string &out, uint64_t timeout_ns) {
    char buf[SG_NOTIFY_MAX];
    const uint64_t end = now_ns() + timeout_ns;
    while (now_ns() < end) {
        size_t len = 0;
        const sg_status_t st = sg_session_next_notification(s, buf, sizeof buf, &len);
        if (st == SG_OK) {
            out.assign(buf, len);
            return true;
        }
        if (st != SG_ERR_AGAIN) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return false;
}

// The prefill side (the forked child): posts each request the decode side announces. Exit status.
int p7_prefill(const std::vector<uint8_t> &key, int port_fd, uint32_t nb, const char *addr, const P7Knobs &knobs) {
    sg_context_t ctx = p7_context(key, addr, knobs);
    if (!ctx) return 1;
    sg_listener_t l = nullptr;
    uint16_t port = 0;
    if (sg_listener_create(ctx, addr, 0, &l, nullptr) != SG_OK || sg_listener_port(l, &port) != SG_OK) return 1;
    if (write(port_fd, &port, sizeof port) != sizeof port) return 1;
    close(port_fd);
    sg_session_t s = nullptr;
    if (sg_session_accept(l, nullptr, 30 * kSecond, &s, nullptr) != SG_OK) return 1;
    sg_listener_destroy(l);
    P7Pool src;
    if (!p7_pool(ctx, nb, 0x5a, src) || sg_session_export_kv(s, src.kv) != SG_OK) return 1;
    std::vector<uint32_t> table(nb);
    for (uint32_t i = 0; i < nb; ++i) table[i] = i;
    std::string note;
    while (next_note(s, note, 300 * kSecond)) {
        if (note == "end") break;
        char id[64];
        unsigned paths = 0;
        if (std::sscanf(note.c_str(), "go %63s %u", id, &paths) != 2) return 1;
        sg_transfer_options_t o;
        sg_transfer_options_init(&o);
        o.paths = paths;
        o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_transfer_t p = nullptr;
        if (sg_transfer_post(s, id, src.kv, table.data(), nb, uint64_t(nb) * kP7Tpb, &o, &p, nullptr) != SG_OK)
            return 1;
        sg_status_t st;
        while ((st = sg_transfer_wait(p, kSecond)) == SG_ERR_TIMEOUT) {
        }
        sg_transfer_release(p);
        if (st != SG_OK) return 1;
    }
    sg_session_close(s, 5 * kSecond);
    sg_session_destroy(s);
    sg_kv_deregister(src.kv);
    sg_context_destroy(ctx);
    return 0;
}

// One request on the decode side: idle (on-demand only: nothing else moves) or busy (on-demand +
// speculative, the bulk sent at once). Times fetches of `per_fetch` non-resident blocks, fetch call to
// sg_transfer_wait_blocks, `gap_us` apart: `count` of them when idle, as many as the bulk lasts when busy
// (count 0 when busy: no fetches, the bulk's own rate).
bool p7_request(sg_session_t s, P7Pool &dst, const std::string &id, bool busy, uint32_t nb, int count,
                uint32_t per_fetch, int gap_us, std::mt19937 &rng, P7Result &res) {
    std::vector<uint32_t> table(nb);
    for (uint32_t i = 0; i < nb; ++i) table[i] = nb - 1 - i;  // scattered on the decode side: reversed
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    sg_transfer_t d = nullptr;
    if (sg_transfer_expect(s, id.c_str(), dst.kv, table.data(), nb, uint64_t(nb) * kP7Tpb, &o, &d, nullptr) != SG_OK)
        return false;
    const unsigned paths = SG_PATH_ON_DEMAND | (busy ? SG_PATH_SPECULATIVE : 0u);
    const std::string go = "go " + id + " " + std::to_string(paths);
    if (sg_session_notify(s, go.data(), go.size()) != SG_OK) return false;
    std::vector<uint8_t> bits((nb + 7) / 8);
    std::uniform_int_distribution<uint32_t> layer_d(0, kP7Layers - 1);
    // Wait for the match (a fetch is refused before it): an untimed probe fetch of one block of the
    // last layer, then a gap (so that, busy, the speculative path has resumed after its yield).
    bool matched = busy && count == 0;  // the bulk alone needs no fetch
    for (int i = 0; i < 100000 && !matched; ++i) {
        uint32_t state = 0;
        sg_status_t st = sg_transfer_layer_state(d, 0, &state);
        if (st != SG_OK) return false;
        const uint32_t probe = nb - 1;
        st = sg_transfer_fetch(d, kP7Layers - 1, &probe, 1);
        if (st == SG_OK) {
            matched = true;
            if (sg_transfer_wait_blocks(d, kP7Layers - 1, &probe, 1, 30 * kSecond) != SG_OK) return false;
            if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
        } else if (st == SG_ERR_INVALID_STATE) {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {
            return false;
        }
    }
    if (!matched) return false;
    std::vector<uint32_t> want;
    int done = 0;
    while (busy ? count != 0 && sg_transfer_test(d) == SG_IN_PROGRESS && done < 100000 : done < count) {
        // A layer with blocks still missing, and per_fetch of them at random.
        want.clear();
        for (int tries = 0; tries < 64 && want.empty(); ++tries) {
            const uint32_t layer = layer_d(rng);
            size_t n = 0;
            if (sg_transfer_residency(d, layer, bits.data(), bits.size(), &n) != SG_OK) return false;
            std::vector<uint32_t> missing;
            for (uint32_t b = 0; b < nb; ++b)
                if (!((bits[b / 8] >> (b % 8)) & 1u)) missing.push_back(b);
            if (missing.size() < per_fetch) continue;
            std::shuffle(missing.begin(), missing.end(), rng);
            want.assign(missing.begin(), missing.begin() + per_fetch);
            std::sort(want.begin(), want.end());
            const uint64_t t0 = now_ns();
            if (sg_transfer_fetch(d, layer, want.data(), want.size()) != SG_OK) return false;
            const sg_status_t st = sg_transfer_wait_blocks(d, layer, want.data(), want.size(), 30 * kSecond);
            const uint64_t t1 = now_ns();
            if (st != SG_OK) return false;
            (busy ? res.busy_ms : res.idle_ms).push_back(double(t1 - t0) / 1e6);
            ++done;
        }
        if (want.empty()) break;  // nothing left to fetch
        if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    }
    if (busy) {
        sg_status_t st;
        while ((st = sg_transfer_wait(d, kSecond)) == SG_ERR_TIMEOUT) {
        }
        if (st != SG_OK) return false;
        sg_transfer_stats_t ts;
        sg_transfer_stats_init(&ts);
        if (sg_transfer_stats(d, &ts) == SG_OK && ts.end_ns > ts.start_ns)
            (count ? res.bulk_gbps : res.bulk_alone_gbps).push_back(double(ts.bytes) / double(ts.end_ns - ts.start_ns));
    }
    return sg_transfer_release(d) == SG_OK;
}

// Enters network namespace `name` (/var/run/netns/NAME, made by scripts/netns-link.sh).
bool enter_netns(const std::string &name) {
    const int fd = open(("/var/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool ok = setns(fd, CLONE_NEWNET) == 0;
    close(fd);
    return ok;
}

void put_doubles(std::string &out, const std::vector<double> &v) {
    const uint64_t n = v.size();
    out.append(reinterpret_cast<const char *>(&n), sizeof n);
    out.append(reinterpret_cast<const char *>(v.data()), n * sizeof(double));
}

bool get_doubles(const std::string &in, size_t &pos, std::vector<double> &v) {
    uint64_t n = 0;
    if (pos + sizeof n > in.size()) return false;
    std::memcpy(&n, in.data() + pos, sizeof n);
    pos += sizeof n;
    if (pos + n * sizeof(double) > in.size()) return false;
    v.resize(n);
    std::memcpy(v.data(), in.data() + pos, n * sizeof(double));
    pos += n * sizeof(double);
    return true;
}

// The decode side (a forked child): connects, runs the requests, writes its results to out_fd.
int p7_decode(const std::vector<uint8_t> &key, uint16_t port, uint32_t nb, int reps, int idle_fetches,
              uint32_t per_fetch, int gap_us, const char *peer, const char *addr, int out_fd) {
    P7Result res;
    sg_context_t ctx = p7_context(key, addr);
    sg_session_t s = nullptr;
    P7Pool dst;
    std::string why;
    bool ok = false;
    if (!ctx) {
        why = std::string("sg_context_create: ") + sg_last_error_message();
    } else if (sg_session_connect(ctx, peer, port, nullptr, 30 * kSecond, &s, nullptr) != SG_OK) {
        why = std::string("sg_session_connect: ") + sg_last_error_message();
    } else if (!p7_pool(ctx, nb, 0, dst) || sg_session_export_kv(s, dst.kv) != SG_OK) {
        why = std::string("pool: ") + sg_last_error_message();
    } else {
        char prov[64] = "";
        sg_session_provider(s, prov, sizeof prov);
        res.provider = prov;
        std::mt19937 rng(7);
        progress(kBench, "P7: the speculative transfer alone (no fetches)");
        ok = p7_request(s, dst, "alone", true, nb, 0, per_fetch, gap_us, rng, res);
        for (int r = 0; r < reps && ok; ++r) {
            progress(kBench, "P7 rep " + std::to_string(r + 1) + "/" + std::to_string(reps) + ": idle fetches");
            ok = p7_request(s, dst, "idle-" + std::to_string(r), false, nb, idle_fetches, per_fetch, gap_us, rng, res);
            if (!ok) break;
            progress(kBench, "P7 rep " + std::to_string(r + 1) + "/" + std::to_string(reps) + ": fetches during a " +
                                 human_bytes(uint64_t(nb) * kP7Layers * kP7BlockBytes) + " speculative transfer");
            ok = p7_request(s, dst, "busy-" + std::to_string(r), true, nb, -1, per_fetch, gap_us, rng, res);
        }
        if (!ok) why = std::string("transfer: ") + sg_last_error_message();
        const std::string end = "end";
        sg_session_notify(s, end.data(), end.size());
        sg_session_close(s, 5 * kSecond);
    }
    sg_session_destroy(s);
    if (dst.kv) sg_kv_deregister(dst.kv);
    sg_context_destroy(ctx);
    std::string out;
    const uint64_t n = ok ? res.provider.size() : 0;
    out.append(reinterpret_cast<const char *>(&n), sizeof n);
    out += res.provider;
    put_doubles(out, res.idle_ms);
    put_doubles(out, res.busy_ms);
    put_doubles(out, res.bulk_gbps);
    put_doubles(out, res.bulk_alone_gbps);
    size_t off = 0;
    while (off < out.size()) {
        const ssize_t w = write(out_fd, out.data() + off, out.size() - off);
        if (w <= 0) break;
        off += size_t(w);
    }
    close(out_fd);
    if (!ok) std::fprintf(stderr, "smartgen-bench ttst: P7 decode side: %s\n", why.c_str());
    return ok ? 0 : 1;
}

// Forks the prefill side and the decode side (before any SmartGen call: a context does not survive
// fork()), on 127.0.0.1 or, with `netns`, in the namespaces sg-prefill and sg-decode of
// scripts/netns-link.sh (so every byte crosses the shaped link). The decode side runs the bulk alone
// once, then `reps` pairs (idle, busy) alternated. Returns false with `why`.
bool run_p7(uint64_t bulk_bytes, int reps, int idle_fetches, uint32_t per_fetch, int gap_us, bool netns,
            const P7Knobs &knobs, P7Result &res, std::string &why) {
    const uint32_t nb = uint32_t(std::max<uint64_t>(bulk_bytes / (kP7Layers * kP7BlockBytes), 8));
    const char *pf_addr = netns ? "198.51.100.1" : "127.0.0.1";
    const char *dc_addr = netns ? "198.51.100.2" : "127.0.0.1";
    std::vector<uint8_t> key(32);
    std::random_device rd;
    for (auto &b : key) b = uint8_t(rd());
    int pp[2], rp[2];
    if (pipe(pp) != 0 || pipe(rp) != 0) {
        why = "pipe failed";
        return false;
    }
    std::fflush(nullptr);
    const pid_t prefill = fork();
    if (prefill < 0) {
        why = "fork failed";
        return false;
    }
    if (prefill == 0) {
        close(pp[0]);
        close(rp[0]);
        close(rp[1]);
        if (netns && !enter_netns("sg-prefill")) _exit(3);
        _exit(p7_prefill(key, pp[1], nb, pf_addr, knobs));
    }
    close(pp[1]);
    uint16_t port = 0;
    const bool got_port = read(pp[0], &port, sizeof port) == sizeof port;
    close(pp[0]);
    if (!got_port) {
        close(rp[0]);
        close(rp[1]);
        int st = 0;
        waitpid(prefill, &st, 0);
        why = "the prefill process did not start (exit " + std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ")";
        return false;
    }
    std::fflush(nullptr);
    const pid_t decode = fork();
    if (decode == 0) {
        close(rp[0]);
        if (netns && !enter_netns("sg-decode")) _exit(3);
        _exit(p7_decode(key, port, nb, reps, idle_fetches, per_fetch, gap_us, pf_addr, dc_addr, rp[1]));
    }
    close(rp[1]);
    std::string in;
    char buf[65536];
    ssize_t n;
    while ((n = read(rp[0], buf, sizeof buf)) > 0) in.append(buf, size_t(n));
    close(rp[0]);
    int dst_st = 0, pst = 0;
    if (decode > 0) waitpid(decode, &dst_st, 0);
    const bool decode_ok = decode > 0 && WIFEXITED(dst_st) && WEXITSTATUS(dst_st) == 0;
    if (!decode_ok) kill(prefill, SIGTERM);
    waitpid(prefill, &pst, 0);
    if (!decode_ok) {
        why = "the decode process failed";
        return false;
    }
    if (!(WIFEXITED(pst) && WEXITSTATUS(pst) == 0)) {
        why = "the prefill process failed";
        return false;
    }
    size_t pos = 0;
    uint64_t plen = 0;
    if (in.size() < sizeof plen) {
        why = "no results from the decode process";
        return false;
    }
    std::memcpy(&plen, in.data(), sizeof plen);
    pos = sizeof plen;
    if (pos + plen > in.size()) {
        why = "truncated results";
        return false;
    }
    res.provider = in.substr(pos, plen);
    pos += plen;
    if (!get_doubles(in, pos, res.idle_ms) || !get_doubles(in, pos, res.busy_ms) ||
        !get_doubles(in, pos, res.bulk_gbps) || !get_doubles(in, pos, res.bulk_alone_gbps)) {
        why = "truncated results";
        return false;
    }
    return true;
}

}  // namespace

int run_ttst(const Common &c) {
    Flags f(kBench, c.rest);
    const auto link_flag = f.take("--link");
    const auto models_flag = f.take("--models");
    const auto tokens_flag = f.take("--tokens");
    const auto budgets_flag = f.take("--budgets");
    const auto runs_flag = f.take("--runs");
    const auto provider_flag = f.take("--provider");
    const auto disagg_flag = f.take("--disagg");
    const auto p7_bytes_flag = f.take("--p7-bytes");
    const auto p7_reps_flag = f.take("--p7-reps");
    const auto iperf_flag = f.take("--iperf-seconds");
    const auto p7_gap_flag = f.take("--p7-gap-us");
    const auto p7_inflight_flag = f.take("--p7-session-inflight");
    const auto p7_max_op_flag = f.take("--p7-max-op");
    const bool no_p7 = f.take_switch("--no-p7");
    const bool p7_only = f.take_switch("--p7-only");
    const auto selective_args_flag = f.take("--selective-args");
    const std::string selective_args = selective_args_flag ? *selective_args_flag : "";
    f.finish();

    std::string link = "loopback";
    if (link_flag) {
        if (*link_flag != "10gbit" && *link_flag != "5gbit" && *link_flag != "1gbit" && *link_flag != "loopback")
            bad_flag("--link", "give 10gbit, 5gbit, 1gbit or loopback, not '" + *link_flag + "'");
        link = *link_flag;
    }
    const bool netns = link != "loopback";
    if (netns && geteuid() != 0) bad_flag("--link", "a shaped link needs root (network namespaces and tc)");

    // Sweep points.
    std::vector<Point> points;
    const std::vector<std::string> all_models = {"llama3-8b", "qwen3-8b", "llama3-70b"};
    std::vector<std::string> models = c.quick ? std::vector<std::string>{"llama3-8b"} : all_models;
    if (models_flag) {
        models = split(*models_flag, ',');
        for (const auto &m : models)
            if (std::find(all_models.begin(), all_models.end(), m) == all_models.end())
                bad_flag("--models", "'" + m + "': give llama3-8b, qwen3-8b or llama3-70b");
    }
    std::vector<uint64_t> tokens_list;
    if (tokens_flag) {
        for (const auto &t : split(*tokens_flag, ',')) {
            try {
                tokens_list.push_back(parse_bytes(t));
            } catch (const std::exception &) {
                bad_flag("--tokens", "'" + t + "' is not a token count (8K, 16384, ...)");
            }
        }
    }
    for (const auto &m : models) {
        std::vector<uint64_t> ts = tokens_list;
        if (ts.empty()) {
            if (c.quick)
                ts = {8192};
            else if (m == "llama3-70b")
                ts = {8192, 16384};
            else
                ts = {8192, 16384, 32768};
        }
        for (auto t : ts) points.push_back({m, t});
    }
    std::vector<double> budgets = c.quick ? std::vector<double>{0.125} : std::vector<double>{0.25, 0.125, 0.0625};
    if (budgets_flag) {
        budgets.clear();
        for (const auto &b : split(*budgets_flag, ',')) {
            double v = 0;
            const auto slash = b.find('/');
            try {
                v = slash == std::string::npos ? std::stod(b)
                                               : std::stod(b.substr(0, slash)) / std::stod(b.substr(slash + 1));
            } catch (const std::exception &) {
                v = 0;
            }
            if (!(v > 0 && v <= 1)) bad_flag("--budgets", "'" + b + "': give fractions such as 1/8 or 0.125");
            budgets.push_back(v);
        }
    }
    // At least 8 runs a latency claim (docs/benchmarks.md): min, median and max of each figure.
    int runs = c.quick ? 1 : 8;
    if (runs_flag) {
        runs = std::atoi(runs_flag->c_str());
        if (runs < 1 || runs > 100) bad_flag("--runs", "give 1..100");
    }
    const std::string provider = provider_flag ? *provider_flag : "tcp";
    std::string disagg = disagg_flag ? *disagg_flag : "";
    if (disagg.empty())
        if (const char *e = std::getenv("SMARTGEN_DISAGG")) disagg = e;
    if (disagg.empty()) disagg = SMARTGEN_DISAGG_BINARY;
    const std::string iperf_s = iperf_flag ? *iperf_flag : "2";
    uint64_t p7_bytes = c.quick ? (512ull << 20) : (1ull << 30);
    if (p7_bytes_flag) {
        try {
            p7_bytes = parse_bytes(*p7_bytes_flag);
        } catch (const std::exception &) {
            bad_flag("--p7-bytes", "'" + *p7_bytes_flag + "' is not a size");
        }
    }
    int p7_reps = c.quick ? 2 : 5;
    if (p7_reps_flag) {
        p7_reps = std::atoi(p7_reps_flag->c_str());
        if (p7_reps < 1 || p7_reps > 100) bad_flag("--p7-reps", "give 1..100");
    }

    // Fetches 15 ms apart: the runtime's speculative path posts nothing for 10 ms after a fetch
    // (kSpeculativeYieldNs, runtime/core/paths.cpp), so closer fetches would find the bulk paused and
    // measure an idle link; 15 ms apart, each finds it running again.
    const int p7_gap_us = p7_gap_flag ? std::atoi(p7_gap_flag->c_str()) : 15000;
    if (p7_gap_us < 0 || p7_gap_us > 1000000) bad_flag("--p7-gap-us", "give 0..1000000");

    P7Knobs knobs;
    try {
        if (p7_inflight_flag) knobs.session_inflight = parse_bytes(*p7_inflight_flag);
        if (p7_max_op_flag) knobs.max_op = parse_bytes(*p7_max_op_flag);
    } catch (const std::exception &) {
        bad_flag("--p7-session-inflight/--p7-max-op", "give a size such as 512K");
    }

    Report report(c);
    int status = 0;
    const std::string src = SMARTGEN_SOURCE_DIR;

    if (!p7_only && (disagg.empty() || access(disagg.c_str(), X_OK) != 0)) {
        std::fprintf(stderr,
                     "smartgen-bench ttst: smartgen-disagg not found ('%s'): build it (-DSMARTGEN_BUILD_EXAMPLES=ON), "
                     "or name it with --disagg PATH or SMARTGEN_DISAGG\n",
                     disagg.c_str());
        return 1;
    }
    // A link that is already up is remade at the rate asked for and left up at the end; one this
    // run makes is taken down.
    const bool link_was_up = netns && run_child({"ip", "netns", "pids", "sg-prefill"}, {}).rc == 0;
    if (netns) {
        progress(kBench, "making the link: scripts/netns-link.sh up --rate " + link + " --latency-ms 1");
        const auto r =
            run_child({"bash", src + "/scripts/netns-link.sh", "up", "--rate", link, "--latency-ms", "1"}, {});
        if (r.rc != 0) {
            std::fprintf(stderr, "smartgen-bench ttst: netns-link.sh up failed (exit %d):\n%s%s", r.rc, r.out.c_str(),
                         r.err.c_str());
            return 1;
        }
    }
    if (!p7_only) {
        std::vector<Config> configs = {{"full-after", 0, {"--mode", "full", "--full-stream", "off"}},
                                       {"full-streamed", 0, {"--mode", "full", "--full-stream", "on"}}};
        // --attend resident: P is what is resident when a layer's essential blocks are (the proactive set
        // and whatever the speculative path had delivered by then; at 8K tokens that was within a point
        // of the budget set here, reported as proactive_fraction). The default, --attend budget, has
        // smartgen-disagg's prefill side make the proactive selection a second time to tell the decode
        // side which blocks it chose (the runtime does not say), which on two cores takes CPU time from
        // the transfer that no serving stack would spend; this benchmark measures the transfer.
        for (double b : budgets) {
            configs.push_back(
                {"selective", b, {"--mode", "selective", "--budget", fmt("%.6g", b), "--attend", "resident"}});
            // --selective-args: smartgen-disagg flags for the selective rows only (the ablations of
            // docs/benchmarks.md: --parallel off, --prefetch off, ...), split at spaces.
            for (const auto &a : split(selective_args, ' '))
                if (!a.empty()) configs.back().args.push_back(a);
        }

        double lo_tcp_bps = NAN;
        if (!netns) {
            lo_tcp_bps = loopback_tcp_bps(c.quick ? (512ull << 20) : (2ull << 30));
            progress(kBench,
                     "raw TCP over loopback (one stream, 1 MiB sends): " + fmt("%.2f", lo_tcp_bps / 1e9) + " Gbit/s");
        }

        for (const auto &pt : points) {
            std::map<size_t, std::vector<Run>> results;  // config index -> runs
            bool failed = false;
            for (int rep = 0; rep < runs && !failed; ++rep) {
                for (size_t ci = 0; ci < configs.size() && !failed; ++ci) {
                    const auto &cf = configs[ci];
                    std::vector<std::string> args = cf.args;
                    for (const auto &a : {std::string("--emulate"), pt.model, std::string("--emulate-tokens"),
                                          std::to_string(pt.tokens), std::string("--max-new-tokens"),
                                          std::string("256"), std::string("--timeout"), std::string("60"),
                                          std::string("--json")})
                        args.push_back(a);
                    std::vector<std::string> argv, env;
                    if (netns) {
                        argv = {"bash", src + "/scripts/netns-disagg.sh", "--keep-link", "--iperf-seconds", iperf_s,
                                "--"};
                        env = {"SMARTGEN_DISAGG=" + disagg};
                    } else {
                        argv = {disagg, "--provider", provider};
                    }
                    argv.insert(argv.end(), args.begin(), args.end());
                    progress(kBench, pt.model + " " + std::to_string(pt.tokens) + " tokens, " + cf.label +
                                         (cf.budget > 0 ? " " + budget_label(cf.budget) : "") + ", run " +
                                         std::to_string(rep + 1) + "/" + std::to_string(runs) + " (" + link + ")");
                    // One retry: a bootstrap can fail on two busy shared cores; a second failure ends the point.
                    for (int attempt = 0; attempt < 2; ++attempt) {
                        const auto r = run_child(argv, env);
                        try {
                            if (r.rc != 0) throw std::runtime_error("exit status " + std::to_string(r.rc));
                            Run run = parse_run(r.out);
                            if (!netns) run.tcp_bps = lo_tcp_bps;
                            results[ci].push_back(run);
                            break;
                        } catch (const std::exception &e) {
                            std::fprintf(stderr, "smartgen-bench ttst: smartgen-disagg failed (%s)%s: %s\n%s", e.what(),
                                         attempt == 0 ? ", retrying once" : "", r.out.c_str(), r.err.c_str());
                            if (attempt == 1) failed = true, status = 1;
                        }
                    }
                }
            }
            if (failed) continue;
            const auto &after = results[0], &streamed = results[1];
            const double stall_after = med(after, &Run::stall), stall_streamed = med(streamed, &Run::stall);
            const double ttst_after = med(after, &Run::ttst), ttst_streamed = med(streamed, &Run::ttst);
            const double tcp_bps = [&] {
                std::vector<Run> all;
                for (const auto &[k, v] : results) all.insert(all.end(), v.begin(), v.end());
                return med(all, &Run::tcp_bps);
            }();
            const double nominal = netns ? med(after, &Run::nominal_bps) : NAN;
            // The full baseline's rate: KV payload over the stall of the transfer posted after prefill
            // (decode's step 2 waits for the last layer; the step itself is a few ms).
            const double full_bps = med(after, &Run::bytes_full) * 8.0 / (stall_after / 1e3);
            for (size_t ci = 0; ci < configs.size(); ++ci) {
                const auto &cf = configs[ci];
                const auto &rs = results[ci];
                Line l;
                l.bench = kBench;
                l.value = med(rs, &Run::ttst);
                l.unit = "ms";
                l.baseline_name = "full streamed";
                l.baseline_value = ttst_streamed;
                l.ratio = ttst_streamed / l.value;  // TTST: lower is better, > 1 favours this row
                l.provider = rs.empty() ? provider : rs.front().provider;
                l.op = cf.label;
                l.pattern = pt.model;
                l.link = link;
                l.block_bytes = 2ull * 16 * 8 * 128 * 2;
                l.total_bytes = kv_bytes(pt.model, pt.tokens);
                l.extra["tokens"] = double(pt.tokens);
                if (cf.budget > 0) l.extra["budget"] = cf.budget;
                l.extra["ttft_ms"] = med(rs, &Run::ttft);
                l.extra["ttst_ms"] = l.value;
                l.extra["stall_ms"] = med(rs, &Run::stall);
                l.extra["stall_min_ms"] = lo(rs, &Run::stall);
                l.extra["stall_max_ms"] = hi(rs, &Run::stall);
                l.extra["tpot_ms"] = med(rs, &Run::tpot);
                l.extra["complete_ms"] = med(rs, &Run::complete);
                l.extra["bytes_full"] = med(rs, &Run::bytes_full);
                l.extra["bytes_proactive"] = med(rs, &Run::bytes_proactive);
                l.extra["bytes_on_demand"] = med(rs, &Run::bytes_on_demand);
                l.extra["bytes_speculative"] = med(rs, &Run::bytes_speculative);
                l.extra["digest_bytes"] = med(rs, &Run::digest);
                // Every byte moved: every path's KV and the digests (sg_transfer_stats' bytes), and that
                // total over the whole KV cache (total_bytes); digest_share = digests / that total.
                l.extra["bytes"] = med(rs, &Run::bytes);
                l.extra["bytes_of_kv"] = med(rs, &Run::bytes) / double(kv_bytes(pt.model, pt.tokens));
                if (med(rs, &Run::bytes) > 0) l.extra["digest_share"] = med(rs, &Run::digest) / med(rs, &Run::bytes);
                l.extra["first_step_wait_ms"] = med(rs, &Run::first_wait_ms);
                l.extra["runs"] = double(rs.size());
                if (std::isfinite(tcp_bps)) l.extra["link_tcp_bps"] = tcp_bps;
                if (std::isfinite(nominal)) l.extra["link_nominal_bps"] = nominal;
                if (cf.label == "selective") {
                    const double calls = med(rs, &Run::fetch_calls);
                    l.extra["fetch_calls"] = calls;
                    l.extra["fetch_wait_ms"] = med(rs, &Run::fetch_wait_ms);
                    if (calls > 0) l.extra["fetch_wait_per_call_ms"] = med(rs, &Run::fetch_wait_ms) / calls;
                    l.extra["sparse_steps"] = med(rs, &Run::sparse_steps);
                    if (std::isfinite(med(rs, &Run::proactive_fraction)))
                        l.extra["proactive_fraction"] = med(rs, &Run::proactive_fraction);
                    if (std::isfinite(med(rs, &Run::attended_fraction)))
                        l.extra["attended_fraction"] = med(rs, &Run::attended_fraction);
                    if (std::isfinite(med(rs, &Run::essential_wait_ms)))
                        l.extra["essential_wait_ms"] = med(rs, &Run::essential_wait_ms);
                    for (const auto &[key, field] :
                         {std::pair{"stall_first_message_ms", &Run::stall_first_message_ms},
                          std::pair{"stall_selector_ms", &Run::stall_selector_ms},
                          std::pair{"stall_fetch_wait_ms", &Run::stall_fetch_wait_ms},
                          std::pair{"stall_fetch_calls", &Run::stall_fetch_calls},
                          std::pair{"stall_modelled_selection_ms", &Run::stall_modelled_sel_ms}})
                        if (std::isfinite(med(rs, field))) l.extra[key] = med(rs, field);
                    if (!selective_args.empty()) l.extra_text["selective_args"] = selective_args;
                    if (std::isfinite(med(rs, &Run::selector_ms)) && med(rs, &Run::sparse_steps) > 0) {
                        l.extra["selector_ms"] = med(rs, &Run::selector_ms);  // all sparse steps
                        l.extra["selector_per_step_ms"] = med(rs, &Run::selector_ms) / med(rs, &Run::sparse_steps);
                    }
                    l.extra_text["complete_is"] =
                        "estimate";  // TTST + (sparse steps - 1) x TPOT + decode's wait for the rest
                } else {
                    l.extra_text["complete_is"] = "TTST bound";  // decode's step 2 waits for every layer
                }
                if (cf.label == "full-after" && std::isfinite(full_bps)) {
                    l.extra["full_bps"] = full_bps;
                    if (std::isfinite(tcp_bps)) l.extra["full_of_tcp"] = full_bps / tcp_bps;
                }
                l.note =
                    pt.model + " " + std::to_string(pt.tokens / 1024) + "K " + cf.label +
                    (cf.budget > 0 ? " " + budget_label(cf.budget) : "") + ": TTFT " + fmt("%.1f", l.extra["ttft_ms"]) +
                    " stall " + fmt("%.1f", l.extra["stall_ms"]) + " ms; moved " +
                    fmt("%.1f", 100.0 * l.extra["bytes_of_kv"]) + "% of the KV" +
                    (l.extra["digest_bytes"] > 0
                         ? " (digests " + fmt("%.1f", 100.0 * l.extra["digest_bytes"] / l.extra["bytes"]) + "% of it)"
                         : std::string());
                report.add(l);

                // P4: Llama-3-8B at budget 1/8.
                if (cf.label == "selective" && pt.model == "llama3-8b" && std::fabs(cf.budget - 0.125) < 1e-9) {
                    const double stall_sg = med(rs, &Run::stall), ttst_sg = med(rs, &Run::ttst);
                    Line p = l;
                    p.figure = "P4";
                    p.value = stall_sg;
                    p.baseline_name = "full streamed";
                    p.baseline_value = stall_streamed;
                    p.ratio = stall_streamed / stall_sg;  // stall: lower is better
                    p.extra["target"] = 10;
                    p.extra["stall_full_streamed_ms"] = stall_streamed;
                    p.extra["stall_full_after_ms"] = stall_after;
                    p.extra["stall_ratio_vs_after"] = stall_after / stall_sg;
                    p.extra["ttst_ratio_vs_streamed"] = ttst_streamed / ttst_sg;
                    p.extra["ttst_ratio_vs_after"] = ttst_after / ttst_sg;
                    // The share of the achievable TTST reduction reached: streaming everything cannot
                    // beat TTFT, so (TTST_full - TTST_smartgen) / (TTST_full - TTFT).
                    p.extra["ttst_reduction_share"] = (ttst_streamed - ttst_sg) / (ttst_streamed - med(rs, &Run::ttft));
                    const double stall_model = med(rs, &Run::stall_modelled_sel_ms);
                    if (std::isfinite(stall_model)) {
                        p.extra["stall_modelled_selection_ms"] = stall_model;
                        p.extra["ratio_modelled_selection"] = stall_streamed / stall_model;
                        p.extra["target_modelled_selection"] = 20;
                    }
                    if (std::isfinite(full_bps)) p.extra["full_bps"] = full_bps;
                    if (std::isfinite(full_bps) && std::isfinite(tcp_bps)) p.extra["full_of_tcp"] = full_bps / tcp_bps;
                    p.extra_text.erase("complete_is");
                    p.note = "P4 " + std::to_string(pt.tokens / 1024) + "K over " + link + ": stall full streamed " +
                             fmt("%.1f", stall_streamed) + " / SmartGen " + fmt("%.1f", stall_sg) +
                             " ms = " + fmt("%.2f", p.ratio) + "x (target >= 10)" +
                             (std::isfinite(stall_model) ? "; selection modelled: " + fmt("%.1f", stall_model) + " ms = " +
                                                               fmt("%.2f", stall_streamed / stall_model) + "x (target >= 20)"
                                                         : std::string()) +
                             "; TTST " +
                             fmt("%.2f", ttst_streamed / ttst_sg) + "x vs streamed, " +
                             fmt("%.2f", ttst_after / ttst_sg) + "x vs after prefill; full carried " +
                             (std::isfinite(full_bps) ? fmt("%.2f", full_bps / 1e9) : std::string("?")) +
                             " Gbit/s of " + (std::isfinite(tcp_bps) ? fmt("%.2f", tcp_bps / 1e9) : std::string("?")) +
                             " raw TCP; SmartGen moved " + fmt("%.1f", 100.0 * p.extra["bytes_of_kv"]) +
                             "% of the KV in all, digests (" +
                             fmt("%.1f", 100.0 * p.extra["digest_bytes"] / p.extra["bytes"]) + "% of it) included";
                    report.add(p);

                    // P10 and P11: the whole response against full streamed, in the median and in
                    // the worst run of each (the slowest SmartGen run against the fastest streamed
                    // one: a claim must hold there too).
                    struct Whole {
                        const char *figure, *what;
                        double Run::*field;
                    };
                    for (const Whole &w : {Whole{"P10", "end to end, 64 tokens", &Run::e2e64},
                                           Whole{"P10", "end to end, 256 tokens", &Run::e2e256},
                                           Whole{"P11", "TPOT", &Run::tpot}}) {
                        const double sg = med(rs, w.field), full = med(streamed, w.field);
                        if (!std::isfinite(sg) || !std::isfinite(full)) continue;
                        Line q = l;
                        q.figure = w.figure;
                        q.op = cf.label + ", " + w.what;
                        q.value = sg;
                        q.baseline_name = "full streamed";
                        q.baseline_value = full;
                        q.ratio = full / sg;  // > 1: SmartGen faster
                        q.extra = {};
                        q.extra_text = {};
                        q.extra["tokens"] = double(pt.tokens);
                        q.extra["runs"] = double(rs.size());
                        q.extra["min_ms"] = lo(rs, w.field);
                        q.extra["max_ms"] = hi(rs, w.field);
                        q.extra["full_min_ms"] = lo(streamed, w.field);
                        q.extra["full_max_ms"] = hi(streamed, w.field);
                        q.extra["worst_ratio"] = lo(streamed, w.field) / hi(rs, w.field);
                        if (w.field == &Run::tpot) {
                            q.extra["tpot_sparse_ms"] = med(rs, &Run::tpot_sparse);
                            q.extra["tpot_dense_ms"] = med(rs, &Run::tpot_dense);
                            q.extra["tpot_dense_full_ms"] = med(streamed, &Run::tpot_dense);
                            q.extra["sparse_over_dense"] = med(rs, &Run::tpot_sparse) / med(streamed, &Run::tpot_dense);
                        }
                        q.note = std::string(w.figure) + " " + std::to_string(pt.tokens / 1024) + "K over " + link +
                                 ", " + w.what + ": full streamed " + fmt("%.1f", full) + " / SmartGen " +
                                 fmt("%.1f", sg) + " ms = " + fmt("%.3f", q.ratio) + "x (median of " +
                                 std::to_string(rs.size()) + "); worst run " + fmt("%.3f", q.extra["worst_ratio"]) +
                                 "x; SmartGen " + fmt("%.1f", q.extra["min_ms"]) + "-" + fmt("%.1f", q.extra["max_ms"]) +
                                 " ms, streamed " + fmt("%.1f", q.extra["full_min_ms"]) + "-" +
                                 fmt("%.1f", q.extra["full_max_ms"]) + " ms";
                        report.add(q);
                    }
                }
            }
        }
    }

    if (!no_p7) {
        P7Result res;
        std::string why;
        const uint32_t per_fetch = 4;
        const int gap_us = p7_gap_us;
        progress(kBench, "P7: fetches of 4 x 64 KiB blocks, idle (SG_PATH_ON_DEMAND only) vs during a " +
                             human_bytes(p7_bytes) + " speculative transfer, " + std::to_string(p7_reps) + " reps");
        if (!run_p7(p7_bytes, p7_reps, c.quick ? 30 : 60, per_fetch, gap_us, netns, knobs, res, why)) {
            std::fprintf(stderr, "smartgen-bench ttst: P7 failed: %s\n", why.c_str());
            status = 1;
        } else if (res.idle_ms.empty() || res.busy_ms.empty()) {
            std::fprintf(stderr, "smartgen-bench ttst: P7: no samples (idle %zu, busy %zu)\n", res.idle_ms.size(),
                         res.busy_ms.size());
            status = 1;
        } else {
            Line l;
            l.bench = kBench;
            l.figure = "P7";
            l.value = median(res.busy_ms);
            l.unit = "ms";
            l.baseline_name = "same fetch, idle link";
            l.baseline_value = median(res.idle_ms);
            l.ratio = l.baseline_value / l.value;  // latency: lower is better; P7 target is 1/ratio <= 2
            l.provider = res.provider;
            l.op = "fetch";
            l.pattern = "4 random missing blocks of a random layer";
            l.link = link;
            l.block_bytes = kP7BlockBytes;
            l.total_bytes =
                uint64_t(std::max<uint64_t>(p7_bytes / (kP7Layers * kP7BlockBytes), 8)) * kP7Layers * kP7BlockBytes;
            l.extra["busy_over_idle"] = l.value / l.baseline_value;
            l.extra["busy_p99_ms"] = percentile(res.busy_ms, 99);
            l.extra["idle_p99_ms"] = percentile(res.idle_ms, 99);
            l.extra["busy_over_idle_p99"] = percentile(res.busy_ms, 99) / percentile(res.idle_ms, 99);
            l.extra["busy_samples"] = double(res.busy_ms.size());
            // Fetches that waited about the speculative path's 10 ms yield (runtime/core/paths.cpp): blocks
            // already claimed by a speculative unit that the fetch itself paused?
            l.extra["busy_fraction_9_to_13_ms"] = double(std::count_if(res.busy_ms.begin(), res.busy_ms.end(),
                                                                       [](double v) { return v >= 9 && v < 13; })) /
                                                  double(res.busy_ms.size());
            l.extra["idle_fraction_9_to_13_ms"] = double(std::count_if(res.idle_ms.begin(), res.idle_ms.end(),
                                                                       [](double v) { return v >= 9 && v < 13; })) /
                                                  double(res.idle_ms.size());
            l.extra["idle_samples"] = double(res.idle_ms.size());
            if (!res.bulk_gbps.empty()) l.extra["bulk_with_fetches_GBps"] = median(res.bulk_gbps);
            if (!res.bulk_alone_gbps.empty()) l.extra["bulk_alone_GBps"] = median(res.bulk_alone_gbps);
            l.extra["gap_us"] = gap_us;
            if (knobs.session_inflight) l.extra["prefill_session_inflight_bytes"] = double(knobs.session_inflight);
            if (knobs.max_op) l.extra["prefill_max_op_bytes"] = double(knobs.max_op);
            if (!res.bulk_gbps.empty() && !res.bulk_alone_gbps.empty())
                l.extra["bulk_with_fetches_of_alone"] = median(res.bulk_gbps) / median(res.bulk_alone_gbps);
            l.extra["target"] = 2;
            l.note = "P7: fetch median " + fmt("%.3f", l.value) + " ms during bulk vs " +
                     fmt("%.3f", l.baseline_value) + " ms idle = " + fmt("%.2f", l.value / l.baseline_value) +
                     "x (target <= 2); p99 " + fmt("%.3f", l.extra["busy_p99_ms"]) + " vs " +
                     fmt("%.3f", l.extra["idle_p99_ms"]) + " ms";
            report.add(l);
        }
    }

    if (netns && !link_was_up) {
        const auto r = run_child({"bash", src + "/scripts/netns-link.sh", "down"}, {});
        if (r.rc != 0) std::fprintf(stderr, "smartgen-bench ttst: netns-link.sh down: %s", r.err.c_str());
    }
    if (!c.json) report.print_table();
    if (!c.plot.empty()) {
        report.plot(
            "smartgen-bench ttst: time to second token by prompt length", "prompt tokens", "TTST (ms)",
            [](const Line &l) { return l.extra.count("tokens") ? l.extra.at("tokens") : 0.0; },
            [](const Line &l) {
                std::string s = l.pattern.value_or("") + " " + l.op.value_or("");
                if (l.extra.count("budget")) s += " " + budget_label(l.extra.at("budget"));
                return s;
            });
    }
    return status;
}

}  // namespace sg::bench
