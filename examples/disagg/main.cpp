// smartgen-disagg: disaggregated inference of a llama2.c model (or an emulated big model's KV cache)
// across two processes joined by SmartGen, using only the public C header.
//
//   prefill (parent)                                   decode (child, forked before any SmartGen call)
//   context, listener on 127.0.0.1:0  -- port (pipe) -->  context, sg_session_connect
//   sg_session_accept, register + export the pool          register + export its pool
//   [PRF profile chunks] REQ (prompt length, run params) -> sg_transfer_expect, selector
//   warm-up: one block of every layer moves once           (expected likewise)
//                                        <- READY
//   t0 (prompt held, session and pools warm)
//   sg_transfer_post; prefill, the layer hook marks each layer written (with the last W queries in
//   selective mode); token 1 = argmax of the logits
//   FIRST (token 1, t0, t1)          ------------------>  step 2.. N: per layer, wait for the layer (full)
//                                                          or attend to P u S_t u G (selective)
//                                    <-- RES, TOK.., END   (token times, statistics)
//   release, BYE, close, waitpid, print                    release, wait BYE, close
//
// Notifications (sg_session_notify) carry the small messages, so both sides need nothing but the
// session; with --role each side runs by hand and the prefill side still prints everything.
// Messages are text: "KIND key=value ...", "TOK id id ...", "PRF <json chunk>".
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <smartgen/smartgen.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "emulate.hpp"
#include "engine.hpp"
#include "model_files.hpp"
#include "pool_layout.hpp"
#include "proactive_set.hpp"
#include "select_ahead.hpp"

// The selective-path functions (profiles, selectors, digests, fetches) are referenced weakly: this
// program links and runs its colocated and full modes against a libsmartgen that does not have them
// yet, and --mode selective reports that it is missing instead of failing to load.
#pragma weak sg_profile_parse
#pragma weak sg_profile_load
#pragma weak sg_profile_to_json
#pragma weak sg_profile_destroy
#pragma weak sg_selector_create
#pragma weak sg_selector_destroy
#pragma weak sg_selector_digest_floats
#pragma weak sg_selector_input_init
#pragma weak sg_selector_select
#pragma weak sg_transfer_layer_written_q
#pragma weak sg_transfer_wait_layer_state
#pragma weak sg_transfer_digests
#pragma weak sg_transfer_fetch
#pragma weak sg_transfer_wait_blocks
#pragma weak sg_selector_budget_blocks

namespace sg::disagg {
namespace {

// ---- basics ---------------------------------------------------------------------------------------

// A runtime failure: printed as "smartgen-disagg [role]: message", exit status 1.
class Fatal : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

const char* g_role = "main";
bool g_quiet = false;
pid_t g_child = -1;
int g_child_status = -1;  // set when the child was reaped early

// Whether the loaded libsmartgen has every selective-path function this program uses.
bool selective_available() {
    return sg_profile_parse && sg_profile_load && sg_profile_to_json && sg_profile_destroy && sg_selector_create &&
           sg_selector_destroy && sg_selector_digest_floats && sg_selector_input_init && sg_selector_select &&
           sg_transfer_layer_written_q && sg_transfer_wait_layer_state && sg_transfer_digests && sg_transfer_fetch &&
           sg_transfer_wait_blocks && proactive_mirror_available();
}

uint64_t now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

double ms(uint64_t ns) { return double(ns) / 1e6; }

void sleep_until_ns(uint64_t t) {
    timespec ts{};
    ts.tv_sec = time_t(t / 1000000000ull);
    ts.tv_nsec = long(t % 1000000000ull);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
    }
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, f);
    std::vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

void progress(const std::string& s) {
    if (!g_quiet) std::fprintf(stderr, "[%s] %s\n", g_role, s.c_str());
}

// The last fatal error's text: a side that fails after its session is up tells its peer why (FAIL), so the
// peer stops at once with the reason instead of waiting out its timeout.
std::string g_last_fatal;

[[noreturn]] void fatal(const std::string& s) {
    g_last_fatal = s;
    throw Fatal(s);
}

void check(sg_status_t st, const char* what, const sg_error_info_t* err = nullptr) {
    if (st == SG_OK) return;
    std::string detail = err && err->message[0] ? err->message : sg_last_error_message();
    fatal(fmt("%s failed: %s (%d)%s%s", what, sg_status_str(st), int(st), detail.empty() ? "" : ": ", detail.c_str()));
}

// SmartGen waits answer SG_ERR_TIMEOUT when their timeout passes, which is a failure here.
void check_wait(sg_status_t st, const char* what, int timeout_s) {
    if (st == SG_ERR_TIMEOUT) fatal(fmt("%s: not done after %d s (--timeout)", what, timeout_s));
    check(st, what);
}

// ---- the shared key ---------------------------------------------------------------------------------
// Both sides of one invocation come from one fork, so a random key made before the fork is their
// shared secret; SG_AUTH_KEY_FILE (read by the library) replaces it, and is required with --role.
unsigned char g_key[32];

bool key_file_set() {
    const char* f = std::getenv("SG_AUTH_KEY_FILE");
    return f && *f;
}

void make_key() {
    FILE* f = std::fopen("/dev/urandom", "rb");
    const size_t n = f ? std::fread(g_key, 1, sizeof g_key, f) : 0;
    if (f) std::fclose(f);
    if (n != sizeof g_key) fatal("cannot read 32 random bytes from /dev/urandom for the session key");
}

// ---- messages -------------------------------------------------------------------------------------

struct Msg {
    std::string kind, body;  // body: everything after the kind
    std::map<std::string, std::string> f;

    bool has(const char* k) const { return f.count(k) != 0; }
    const std::string& s(const char* k) const {
        auto it = f.find(k);
        if (it == f.end()) fatal(fmt("message %s lacks field %s", kind.c_str(), k));
        return it->second;
    }
    uint64_t u(const char* k) const { return std::strtoull(s(k).c_str(), nullptr, 10); }
    int64_t i(const char* k) const { return std::strtoll(s(k).c_str(), nullptr, 10); }
    double d(const char* k) const { return std::strtod(s(k).c_str(), nullptr); }
};

Msg parse_msg(const std::string& text) {
    Msg m;
    const size_t sp = text.find(' ');
    m.kind = text.substr(0, sp);
    m.body = sp == std::string::npos ? "" : text.substr(sp + 1);
    if (m.kind == "PRF" || m.kind == "TOK" || m.kind == "FAIL") return m;
    std::istringstream in(m.body);
    std::string kv;
    while (in >> kv) {
        const size_t eq = kv.find('=');
        if (eq != std::string::npos) m.f[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    return m;
}

class Fields {
  public:
    explicit Fields(const char* kind) : s_(kind) {}
    Fields& add(const char* k, const std::string& v) {
        s_ += ' ';
        s_ += k;
        s_ += '=';
        s_ += v;
        return *this;
    }
    Fields& add(const char* k, uint64_t v) { return add(k, std::to_string(v)); }
    Fields& add(const char* k, int64_t v) { return add(k, std::to_string(v)); }
    Fields& add(const char* k, int v) { return add(k, std::to_string(v)); }
    Fields& add(const char* k, uint32_t v) { return add(k, std::to_string(v)); }
    Fields& add(const char* k, double v) { return add(k, fmt("%.17g", v)); }
    const std::string& str() const { return s_; }

  private:
    std::string s_;
};

// ---- SmartGen objects of one side -----------------------------------------------------------------

struct Link {
    sg_context_t ctx = nullptr;
    sg_listener_t listener = nullptr;
    sg_session_t session = nullptr;
    sg_kv_handle_t kv = nullptr;
    sg_transfer_t xfer = nullptr;
    sg_profile_t profile = nullptr;
    sg_selector_t selector = nullptr;
    int evfd = -1;
    int timeout_s = 120;

  private:
    const int uncaught_at_start_ = std::uncaught_exceptions();

  public:

    uint64_t timeout_ns() const { return uint64_t(timeout_s) * 1000000000ull; }

    Link() = default;
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;

    ~Link() {
        // Unwinding from a failure: the peer learns why before the session goes (best effort; a
        // session that is already lost drops it).
        if (session && std::uncaught_exceptions() > uncaught_at_start_) {
            // The peer may have failed first and said why: its reason explains this side's error
            // (a wait that saw the session end, say), so it is shown beside it.
            std::vector<char> buf(SG_NOTIFY_MAX + 1);
            size_t len = 0;
            while (sg_session_next_notification(session, buf.data(), buf.size(), &len) == SG_OK)
                if (len > 5 && std::memcmp(buf.data(), "FAIL ", 5) == 0)
                    std::fprintf(stderr, "smartgen-disagg [%s]: the peer stopped first: %.*s\n", g_role,
                                 int(len - 5), buf.data() + 5);
            const std::string why =
                "FAIL " + std::string(g_role) + " side: " + (g_last_fatal.empty() ? "failed" : g_last_fatal);
            sg_session_notify(session, why.data(), std::min<size_t>(why.size(), SG_NOTIFY_MAX));
            sg_session_close(session, 1000000000ull);
        }
        // Reverse order of creation: a handle goes before what it uses. Errors are ignored here:
        // the orderly path (finish()) already reported them.
        sg_transfer_release(xfer);
        if (selector) sg_selector_destroy(selector);
        if (profile) sg_profile_destroy(profile);
        sg_kv_deregister(kv);
        sg_session_destroy(session);
        sg_listener_destroy(listener);
        sg_context_destroy(ctx);
    }

    void notify(const std::string& text) {
        check(sg_session_notify(session, text.data(), text.size()), "sg_session_notify");
    }

    // The next notification, waiting on the context's event fd; fails when the session is lost, the
    // forked child died, or timeout_s passes.
    // The event fd wakes it for notifications, layer events, transfer ends and session losses; nap_us
    // (20 ms by default, less where a late message would count in a measured wait: the PSET messages
    // a sparse step waits for) bounds the sleep in case a wake-up was taken by another reader.
    Msg next(const char* waiting_for, const std::function<bool()>& idle = {}, long nap_us = 20000) {
        const uint64_t deadline = now_ns() + timeout_ns();
        std::vector<char> buf(SG_NOTIFY_MAX + 1);
        for (;;) {
            size_t len = 0;
            const sg_status_t st = sg_session_next_notification(session, buf.data(), buf.size(), &len);
            if (st == SG_OK) return checked_msg(std::string(buf.data(), len), waiting_for);
            if (st != SG_ERR_AGAIN) check(st, "sg_session_next_notification");
            sg_status_t health = SG_OK;
            char msg[256] = "";
            check(sg_session_error(session, &health, msg, sizeof msg), "sg_session_error");
            // The peer's last message can become readable after its close is seen (the prefill side
            // closes right after BYE): read once more before calling the session failed.
            if (health != SG_OK && sg_session_next_notification(session, buf.data(), buf.size(), &len) == SG_OK)
                return checked_msg(std::string(buf.data(), len), waiting_for);
            if (health != SG_OK)
                fatal(fmt("waiting for %s: the session failed: %s%s%s", waiting_for, sg_status_str(health),
                          msg[0] ? ": " : "", msg));
            if (g_child > 0 && g_child_status < 0) {
                int ws = 0;
                if (waitpid(g_child, &ws, WNOHANG) == g_child) {
                    g_child_status = ws;
                    fatal(fmt("waiting for %s: the decode process exited (%s %d)", waiting_for,
                              WIFEXITED(ws) ? "status" : "signal", WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws)));
                }
            }
            if (now_ns() > deadline)
                fatal(fmt("waiting for %s: nothing after %d s (--timeout)", waiting_for, timeout_s));
            // Idle work goes in small pieces, each followed by a look at the notifications: the
            // message being waited for (FIRST) is taken as soon as it is here.
            if (idle && idle()) continue;
            pollfd p{evfd, POLLIN, 0};
            const timespec nap{nap_us / 1000000, (nap_us % 1000000) * 1000};
            if (ppoll(&p, 1, &nap, nullptr) > 0) {
                uint64_t v;
                if (read(evfd, &v, sizeof v) < 0) { /* re-armed by someone else: fine */
                }
            }
        }
    }

    // A message, unless it is the peer's FAIL: then this side stops with the peer's reason.
    static Msg checked_msg(const std::string& text, const char* waiting_for) {
        Msg m = parse_msg(text);
        if (m.kind == "FAIL") fatal(fmt("waiting for %s: the peer stopped: %s", waiting_for, m.body.c_str()));
        return m;
    }

    Msg expect_msg(const char* kind, const std::function<bool()>& idle = {}) {
        Msg m = next(kind, idle);
        if (m.kind != kind) fatal(fmt("expected a %s message from the peer, got '%s'", kind, m.kind.c_str()));
        return m;
    }
};

void make_context(Link& L, const Options& o, const std::string& local_addr) {
    sg_context_options_t co;
    sg_context_options_init(&co);
    co.provider = o.provider.empty() ? nullptr : o.provider.c_str();
    co.local_addr = local_addr.empty() ? nullptr : local_addr.c_str();
    if (!key_file_set()) {
        co.auth_key = g_key;
        co.auth_key_len = sizeof g_key;
    }
    sg_error_info_t err;
    sg_error_info_init(&err);
    check(sg_context_create(&co, &L.ctx, &err), "sg_context_create", &err);
    check(sg_context_event_fd(L.ctx, &L.evfd), "sg_context_event_fd");
    L.timeout_s = o.timeout_s;
}

void register_pool(Link& L, const KvPool& p) {
    const sg_kv_layout_t layout = layout_of(p);
    sg_error_info_t err;
    sg_error_info_init(&err);
    check(sg_kv_register(L.ctx, &layout, &L.kv, &err), "sg_kv_register", &err);
    check(sg_session_export_kv(L.session, L.kv), "sg_session_export_kv");
}

std::string session_provider(Link& L) {
    char buf[128] = "";
    if (sg_session_provider(L.session, buf, sizeof buf) != SG_OK) return "?";
    return buf;
}

long max_rss_kb() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

// ---- compute: the real engine, or an emulated model -------------------------------------------------

// What each side computes. The prefill side calls prefill() once; the decode side step() per token.
class Compute {
  public:
    virtual ~Compute() = default;
    int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
    uint64_t prompt_len = 0;
    KvPool pool;
    std::vector<uint32_t> table;  // logical block -> pool block (prompt, then generated tokens)

    virtual void make_pool(bool decode_side, uint64_t prompt_len, int n_new, int B, KvDtype dtype) = 0;
    // Runs the prompt; on_layer(l, queries, W) as each layer's KV is in the pool, queries being the
    // last W prompt queries [W][n_heads][head_dim] (nullptr when window is 0). Returns token 1.
    virtual int prefill(int window, const std::function<void(int, const float*, int)>& on_layer) = 0;
    virtual int step(int pos, int token, const AttendSet* attend) = 0;
};

class ModelCompute : public Compute {
  public:
    ModelCompute(const Model& m, std::vector<int> prompt) : m_(m), prompt_(std::move(prompt)), st_(m.config()) {
        const Config& c = m.config();
        n_layers = c.n_layers;
        n_heads = c.n_heads;
        n_kv_heads = c.n_kv_heads;
        head_dim = c.head_size();
    }
    void make_pool(bool decode_side, uint64_t n, int n_new, int B, KvDtype dtype) override {
        prompt_len = n;
        const uint32_t used = std::max<uint32_t>(1, blocks_for(int(n) + n_new - 1, B));
        // The decode side scatters the request over a larger pool in reverse order, so the run also
        // shows SmartGen mapping one side's block table onto the other's.
        const uint32_t total = decode_side ? used + 3 : used;
        storage_ = std::make_unique<KvPoolStorage>(m_.config(), B, total, dtype);
        pool = storage_->view();
        table.resize(used);
        for (uint32_t j = 0; j < used; ++j) table[j] = decode_side ? total - 1 - j : j;
    }
    int prefill(int window, const std::function<void(int, const float*, int)>& on_layer) override {
        PrefillOptions opt;
        opt.window = window;
        opt.capture = window > 0 ? &cap_ : nullptr;
        opt.on_layer_written = [&](int l) {
            if (window == 0) return on_layer(l, nullptr, 0);
            // The capture is [layer][head][row][hs]; SmartGen takes [row][head][hs].
            const int W = cap_.window, H = n_heads, hs = head_dim;
            q_.resize(size_t(W) * H * hs);
            for (int r = 0; r < W; ++r)
                for (int h = 0; h < H; ++h)
                    std::copy(cap_.query(l, h, r), cap_.query(l, h, r) + hs, q_.data() + (size_t(r) * H + h) * hs);
            on_layer(l, q_.data(), W);
        };
        return argmax(sg::disagg::prefill(m_, pool, table, prompt_, st_, opt));
    }
    int step(int pos, int token, const AttendSet* attend) override {
        return argmax(decode_step(m_, pool, table, pos, token, st_, attend));
    }

  private:
    const Model& m_;
    std::vector<int> prompt_;
    RunState st_;
    std::unique_ptr<KvPoolStorage> storage_;
    PrefillCapture cap_;
    std::vector<float> q_;
};

struct EmuParams {
    std::string name;
    uint64_t tokens = 0;
    double tflops = 400, tbps = 4.8, mass = 0.9, overlap = 0.7;
    uint64_t seed = 1;
};

class EmuCompute : public Compute {
  public:
    explicit EmuCompute(const EmuParams& p) : p_(p) {
        shape_ = find_emu_shape(p.name);
        if (!shape_) fatal("unknown emulated model '" + p.name + "'");
        n_layers = shape_->layers;
        n_heads = shape_->n_heads;
        n_kv_heads = shape_->n_kv_heads;
        head_dim = shape_->head_dim;
        cm_.prefill_flops = p.tflops * 1e12;
        cm_.decode_bw = p.tbps * 1e12;
    }
    const EmuShape& shape() const { return *shape_; }
    const ComputeModel& model() const { return cm_; }
    const SyntheticKeys* keys() const { return keys_.get(); }
    // The modelled device's time for one layer's selection: the step's query against the layer's page
    // digests (fp32: min and max per block, KV head and dimension), then top-k.
    double select_s() const {
        const double digest_bytes = double(pool.num_blocks) * n_kv_heads * 2.0 * head_dim * 4.0;
        return SelectionCost().select_s(digest_bytes, cm_.decode_bw);
    }
    int patterns() const { return patterns_; }
    double measured_mass() const { return measured_mass_; }
    uint64_t region_bytes() const { return region_bytes_; }

    // The bounded backing: `patterns` K regions and one V region, each one layer's region; layer l's
    // K base is region l mod patterns, every V base the one V region. Bytes on the wire stay real.
    void make_pool(bool decode_side, uint64_t n, int n_new, int B, KvDtype dtype) override {
        (void)n_new;
        if (dtype != KvDtype::kF16) fatal("emulation uses fp16 KV");
        prompt_len = n;
        const uint32_t nb = blocks_for(int(n), B);
        pool.num_layers = n_layers;
        pool.num_kv_heads = n_kv_heads;
        pool.head_dim = head_dim;
        pool.tokens_per_block = B;
        pool.num_blocks = nb;
        pool.dtype = KvDtype::kF16;
        region_bytes_ = pool.region_bytes();
        // Up to 8 distinct key patterns, within 2 GiB of K regions, on both sides: layers of one
        // pattern share a region and receive the same bytes into it, so the digests the decode side
        // computes of received blocks are the same for every layer of a pattern, whatever order the
        // layers arrive in (select_ahead.hpp relies on it; one shared region would mix patterns).
        // Both sides make the same patterns (the decode side needs them for its queries); only the
        // prefill side fills its keys.
        const uint64_t budget = 2ull << 30;
        patterns_ = std::min(int(std::clamp<uint64_t>(budget / region_bytes_, 1, 8)), n_layers);
        keys_ = std::make_unique<SyntheticKeys>(*shape_, n, B, patterns_, p_.mass, p_.overlap, p_.seed);
        const int k_regions = patterns_;
        for (int r = 0; r < k_regions + 1; ++r) {
            void* mem = std::aligned_alloc(4096, (region_bytes_ + 4095) / 4096 * 4096);
            if (!mem) fatal("out of memory for the emulated pool");
            regions_.emplace_back(mem);
        }
        for (int l = 0; l < n_layers; ++l) {
            pool.k_base.push_back(regions_[size_t(l % k_regions)].get());
            pool.v_base.push_back(regions_[size_t(k_regions)].get());
        }
        if (!decode_side) {
            progress(fmt("synthetic keys: %d pattern(s) x %llu tokens x %d KV heads x %d (%.0f MiB)", patterns_,
                         (unsigned long long)n, n_kv_heads, head_dim, double(region_bytes_) * patterns_ / 1048576.0));
            for (int r = 0; r < patterns_; ++r) keys_->fill_keys(r, static_cast<uint16_t*>(regions_[size_t(r)].get()));
            std::memset(regions_[size_t(patterns_)].get(), 0, region_bytes_);
            measured_mass_ = keys_->measured_mass(0, static_cast<const uint16_t*>(regions_[0].get()));
        }
        table = identity_table(nb);
    }

    int prefill(int window, const std::function<void(int, const float*, int)>& on_layer) override {
        const int W = std::min<int>(window, int(prompt_len));
        std::vector<float> q(size_t(std::max(W, 1)) * n_heads * head_dim);
        const uint64_t layer_ns = uint64_t(cm_.prefill_layer_s(*shape_, prompt_len) * 1e9);
        // Layer l is done at start + (l + 1) * layer time, as on an accelerator that computes on its
        // own: a late wake-up of this thread (two cores shared with the progress threads) or a slow
        // hook does not delay the later layers, unless the hook outlasts a layer.
        const uint64_t start = now_ns();
        for (int l = 0; l < n_layers; ++l) {
            sleep_until_ns(std::max(start + uint64_t(l + 1) * layer_ns, now_ns()));
            if (W > 0) keys_->prefill_queries(keys_->pattern_of(l), W, q.data());
            on_layer(l, W > 0 ? q.data() : nullptr, W);
            if (n_layers >= 8 && (l + 1) % (n_layers / 4) == 0)
                progress(fmt("prefill: layer %d/%d written", l + 1, n_layers));
        }
        return 0;
    }

    // One decode step on the modelled device. The device's clock is an absolute deadline that every
    // modelled cost moves on; the host thread runs ahead of it and sleeps only where the world could
    // see the difference: before the transfer is asked for something (settle(), which the selective
    // decoder calls before each fetch, so no fetch leaves earlier than the device would send it), and
    // at the end of the step. A wait for data moves the deadline to when the data was there. One
    // sleep a step instead of one a layer also spares the step the timer's overshoot per sleep.
    int step(int pos, int token, const AttendSet* attend) override {
        (void)token;
        const int B = pool.tokens_per_block;
        std::vector<float> q(size_t(n_heads) * head_dim);
        const uint64_t generated = uint64_t(pos) + 1 - prompt_len;
        deadline_ns_ = now_ns();
        for (int l = 0; l < n_layers; ++l) {
            keys_->decode_query(keys_->pattern_of(l), steps_, q.data());
            const std::vector<uint32_t>* blocks = nullptr;
            if (attend && attend->select) {
                blocks = attend->select(l, q.data());
                after_wait();
                // A layer attended to in part was selected: the selection's kernels run on the
                // modelled device (a whole layer needs none: the residency test is the host's).
                if (blocks) charge(select_s());
            } else if (attend) {
                blocks = &attend->layer_blocks[size_t(l)];
            }
            uint64_t attended = prompt_len;
            if (blocks) {
                attended = 0;
                for (uint32_t b : *blocks) attended += std::min<uint64_t>(B, prompt_len - uint64_t(b) * B);
            }
            const std::vector<uint32_t>* arriving = attend && attend->arriving ? attend->arriving(l) : nullptr;
            if (arriving && !arriving->empty()) {
                // Parallel on-demand attention: the accelerator attends to the resident part while the
                // arriving blocks travel, then to them, then merges (the same bytes read: the merge
                // itself is a few vector operations per head).
                uint64_t late = 0;
                for (uint32_t b : *arriving) late += std::min<uint64_t>(B, prompt_len - uint64_t(b) * B);
                const double kv = shape_->kv_bytes_per_token_layer() / cm_.decode_bw;
                charge(double(attended - late + generated) * kv);
                attend->wait_arriving(l);
                after_wait();
                charge(cm_.decode_layer_s(*shape_, late) + SelectionCost().merge_s());
                continue;
            }
            charge(cm_.decode_layer_s(*shape_, attended + generated));
        }
        charge(cm_.decode_classifier_s(*shape_));
        settle();
        ++steps_;
        return 0;
    }

    // The host waits for the modelled device to reach its deadline (see step()).
    void settle() const { sleep_until_ns(deadline_ns_); }

  private:
    struct Free {
        void operator()(void* p) const { std::free(p); }
    };
    EmuParams p_;
    const EmuShape* shape_ = nullptr;
    ComputeModel cm_;
    std::unique_ptr<SyntheticKeys> keys_;
    std::vector<std::unique_ptr<void, Free>> regions_;
    int patterns_ = 1;
    uint64_t region_bytes_ = 0;
    double measured_mass_ = 0;
    uint64_t steps_ = 0;
    uint64_t deadline_ns_ = 0;  // the modelled device's clock during step() (absolute)

    void charge(double seconds) { deadline_ns_ += uint64_t(seconds * 1e9); }
    // A wait for the transfer may have outlasted the device's work so far: it resumes from then.
    void after_wait() { deadline_ns_ = std::max(deadline_ns_, now_ns()); }
};

// ---- selective decode: P u S_t u G --------------------------------------------------------------------

// Per layer, at each sparse step: P = the layer's proactive set (--attend budget: the blocks the prefill
// side's profile chose, as its PSET messages say; --attend resident: every block resident when the
// layer's essential blocks were in place, which with the speculative path on includes whatever it had
// delivered), S_t = the selector's blocks for this step's query (with the decode-side profile the
// prefill side sent: quest on the digests from the transfer, the same budget), fetched on demand when
// not resident (or dropped without the on-demand path). The engine adds G (the generated tokens) itself.
//
// Three policies on top (issue 12, each a flag so its share is measured):
// - seamless: a layer whose blocks are all resident is attended whole (no selection, no fetch, exact),
//   and so is one whose missing bytes will arrive, at the measured receive rate, before its selection
//   and fetch would be done (it waits for them instead): on a fast link SmartGen then costs what
//   streaming costs.
// - parallel: select() issues the fetch and returns at once; the engine attends to the resident part,
//   calls wait_arriving(), attends to the arriving part and merges the two (exact log-sum-exp merge).
// - prefetch: at the start of each sparse step after the first, every layer's likely misses (the layer's
//   previous query under the wide profile, --prefetch-scale times the budget) are fetched at once, so the step's true
//   misses mostly arrive without a round trip of their own.
struct SparsePolicies {
    bool on_demand = true, seamless = true, parallel = true, prefetch = true;
    sg_selector_t wide = nullptr;  // the prefetch predictor's selector (a larger budget); may be null
    // Emulated runs: the selections computed ahead on their own thread (select_ahead.hpp), and the
    // modelled accelerator's time for one layer's selection, which the seamless choice weighs instead
    // of this CPU's. Both empty for a real model, whose selection runs here for real.
    SelectionAhead* ahead = nullptr;
    uint64_t modelled_select_ns = 0;
    // Called before every fetch: an emulated run's host thread, which runs ahead of the modelled
    // device, waits for it there (EmuCompute::settle), so no fetch leaves before the device asks.
    std::function<void()> before_fetch;
    uint64_t block_bytes = 0;      // K + V of one block, every layer's the same
    int head_dim = 0;
};

class SparseDecoder {
  public:
    // psets: the PSET messages so far (--attend budget), else nullptr; pump: reads the next
    // notification into psets, for a layer whose P has not arrived yet.
    SparseDecoder(sg_transfer_t x, sg_selector_t sel, int layers, int q_heads, uint32_t prompt_blocks,
                  const SparsePolicies& pol, uint64_t timeout_ns, int timeout_s, const ProactiveSets* psets,
                  std::function<void()> pump)
        : x_(x),
          sel_(sel),
          L_(layers),
          H_(q_heads),
          nb_(prompt_blocks),
          pol_(pol),
          timeout_ns_(timeout_ns),
          timeout_s_(timeout_s),
          psets_(psets),
          pump_(std::move(pump)),
          have_(size_t(layers), 0),
          P_(size_t(layers)),
          digests_(size_t(layers)),
          prev_q_(size_t(layers)),
          prefetched_(size_t(layers)),
          arriving_(size_t(layers)),
          predicted_(size_t(layers), 0) {
        check(sg_selector_digest_floats(sel_, &digest_floats_), "sg_selector_digest_floats");
        layer_select_ns_ = pol_.modelled_select_ns;
        // Keep every layer's digests when they fit in 1 GiB; else read them again at each use. The
        // memory is taken and touched now, before the clock starts: a layer's first read then copies
        // its digests and nothing else (fresh pages cost as much as the copy).
        cache_digests_ = double(digest_floats_) * 4.0 * layers <= double(1ull << 30);
        if (cache_digests_)
            for (auto& d : digests_) d.assign(digest_floats_, 0.0f);
        digests_loaded_.assign(size_t(layers), 0);
        bitmap_.resize((nb_ + 7) / 8);
        S_.resize(nb_);
        W_.resize(nb_);
        for (int l = 0; l < L_; ++l) {
            uint64_t b = 0;
            check(sg_selector_budget_blocks(sel_, uint32_t(l), &b), "sg_selector_budget_blocks");
            budget_blocks = std::max(budget_blocks, b);
        }
    }

    // While decode idles (before token 1 arrives), take in the next layer whose essential blocks (and,
    // with --attend budget, whose PSET) are here, in order: its P set and digests. One layer a call,
    // so the caller looks for token 1 between layers; false when nothing was ready.
    bool prepare_ready() {
        note_received();
        for (int l = 0; l < L_; ++l) {
            if (have_[size_t(l)]) continue;
            uint32_t state = 0;
            check(sg_transfer_layer_state(x_, uint32_t(l), &state), "sg_transfer_layer_state");
            if (!(state & SG_LAYER_ESSENTIAL)) return false;
            if (psets_ && !psets_->complete(uint32_t(l))) return false;
            take_layer(l);
            return true;
        }
        return false;
    }

    // At the start of a sparse step (prefetch): every layer's predicted misses, fetched at once.
    void prefetch_step() {
        for (auto& p : prefetched_) p.clear();
        std::fill(predicted_.begin(), predicted_.end(), 0);
        if (!pol_.prefetch || !pol_.on_demand || !pol_.wide) return;
        const uint64_t t0 = now_ns();
        for (int l = 0; l < L_; ++l) {
            const size_t li = size_t(l);
            if (!have_[li] || prev_q_[li].empty()) continue;
            if (pol_.seamless && layer_ready(l)) continue;
            size_t count = 0;
            sg_selector_input_t in;
            sg_selector_input_init(&in);
            in.queries = prev_q_[li].data();
            in.num_queries = 1;
            in.num_q_heads = uint32_t(H_);
            in.digests = digests(l);
            check(sg_selector_select(pol_.wide, uint32_t(l), &in, W_.data(), W_.size(), &count),
                  "sg_selector_select (prefetch prediction)");
            predicted_[li] = 1;
            read_residency(l);
            std::vector<uint32_t>& pf = prefetched_[li];
            for (size_t i = 0; i < count; ++i)
                if (!resident(W_[i])) pf.push_back(W_[i]);
            if (pf.empty()) continue;
            if (pol_.before_fetch) pol_.before_fetch();
            check(sg_transfer_fetch(x_, uint32_t(l), pf.data(), pf.size()), "sg_transfer_fetch (prefetch)");
            prefetch_calls += 1;
            prefetch_blocks += pf.size();
        }
        prefetch_ns += now_ns() - t0;
    }

    const std::vector<uint32_t>* select(int l, const float* q) {
        const size_t li = size_t(l);
        note_received();
        if (!have_[li]) {
            const uint64_t t = now_ns();
            check_wait(sg_transfer_wait_layer_state(x_, uint32_t(l), SG_LAYER_ESSENTIAL, timeout_ns_),
                       "sg_transfer_wait_layer_state(SG_LAYER_ESSENTIAL)", timeout_s_);
            essential_wait_ns += now_ns() - t;
            take_layer(l);
        }
        arriving_[li].clear();
        if (pol_.prefetch) prev_q_[li].assign(q, q + size_t(H_) * size_t(pol_.head_dim));
        if (pol_.seamless && attend_whole(l)) {
            prefetch_wasted += prefetched_[li].size();
            layer_steps += 1;
            attended_blocks += nb_;
            attended_max = std::max<uint64_t>(attended_max, nb_);
            return nullptr;  // every prompt block
        }
        const float* dig = digests(l);

        sg_selector_input_t in;
        sg_selector_input_init(&in);
        in.queries = q;
        in.num_queries = 1;
        in.num_q_heads = uint32_t(H_);
        in.digests = dig;
        size_t count = 0;
        const bool from_ahead = pol_.ahead && pol_.ahead->take(l, ahead_blocks_);
        if (from_ahead) {
            count = ahead_blocks_.size();
            std::copy(ahead_blocks_.begin(), ahead_blocks_.end(), S_.begin());
            ahead_taken += 1;
        } else if (pol_.ahead) {
            ahead_late += 1;
        }
        if (!from_ahead || check_ahead_) {
            std::vector<uint32_t>& into = from_ahead ? check_blocks_ : S_;
            into.resize(std::max<size_t>(into.size(), nb_));
            const uint64_t t0 = now_ns();
            check(sg_selector_select(sel_, uint32_t(l), &in, into.data(), into.size(), &count),
                  "sg_selector_select (decode-side selection has the step's query and the digests only: "
                  "quest, sinks_recent and dense rules)");
            const uint64_t took = now_ns() - t0;
            selector_ns += took;
            if (!pol_.modelled_select_ns) layer_select_ns_ = layer_select_ns_ ? (3 * layer_select_ns_ + took) / 4 : took;
            if (from_ahead &&
                (count != ahead_blocks_.size() || !std::equal(ahead_blocks_.begin(), ahead_blocks_.end(), into.begin())))
                fatal(fmt("layer %d: the selection computed ahead differs from the inline one", l));
        }
        if (pol_.modelled_select_ns) layer_select_ns_ = pol_.modelled_select_ns;

        read_residency(l);
        missing_.clear();
        const std::vector<uint32_t>& pf = prefetched_[li];
        for (size_t i = 0; i < count; ++i) {
            selected += 1;
            const bool predicted = std::binary_search(pf.begin(), pf.end(), S_[i]);
            if (predicted) prefetch_hits += 1;
            if (resident(S_[i])) {
                if (std::binary_search(P_[li].begin(), P_[li].end(), S_[i])) selected_in_p += 1;
            } else {
                missing_.push_back(S_[i]);
                if (!predicted && predicted_[li]) prefetch_misses += 1;
            }
        }
        for (uint32_t b : pf)
            if (!std::binary_search(S_.begin(), S_.begin() + ptrdiff_t(count), b)) prefetch_wasted += 1;
        size_t n_sel = count;
        if (!missing_.empty()) {
            if (pol_.on_demand) {
                // Blocks the prefetch asked for are on their way: only the rest is fetched now.
                need_.clear();
                for (uint32_t b : missing_)
                    if (!std::binary_search(pf.begin(), pf.end(), b)) need_.push_back(b);
                if (!need_.empty()) {
                    if (pol_.before_fetch) pol_.before_fetch();
                    check(sg_transfer_fetch(x_, uint32_t(l), need_.data(), need_.size()), "sg_transfer_fetch");
                    fetched_blocks += need_.size();
                    fetch_calls += 1;
                }
                if (pol_.parallel) {
                    arriving_[li] = missing_;  // the engine waits (wait_arriving) after the resident part
                } else {
                    wait_arriving(l, missing_);
                }
            } else {  // attend only to what is here
                n_sel = 0;
                for (size_t i = 0; i < count; ++i)
                    if (resident(S_[i])) S_[n_sel++] = S_[i];
                dropped_blocks += missing_.size();
            }
        }
        out_.clear();
        std::set_union(P_[li].begin(), P_[li].end(), S_.begin(), S_.begin() + ptrdiff_t(n_sel),
                       std::back_inserter(out_));
        attended_blocks += out_.size();
        attended_max = std::max<uint64_t>(attended_max, out_.size());
        layer_steps += 1;
        return &out_;
    }

    // Parallel on-demand attention: the blocks of layer l's last selection still in flight, and the
    // wait for them (after the engine attended to the resident part).
    const std::vector<uint32_t>* arriving(int l) const { return &arriving_[size_t(l)]; }
    void wait_arriving(int l) { wait_arriving(l, arriving_[size_t(l)]); }

    // For the report, once decoding is done (--attend budget): P of the layers no sparse step took in
    // (none, when the transfer completed before step 2), from their PSET messages.
    void count_untaken_proactive() {
        if (!psets_) return;
        for (int l = 0; l < L_; ++l) {
            if (have_[size_t(l)]) continue;
            while (!psets_->complete(uint32_t(l))) pump_();
            proactive_blocks += psets_->blocks(uint32_t(l)).size();
            proactive_layers += 1;
        }
    }

    // Everything: wait for the speculative path, or fetch what is missing layer by layer.
    void complete(bool speculative) {
        const uint64_t t = now_ns();
        if (speculative) {
            check_wait(sg_transfer_wait(x_, timeout_ns_), "sg_transfer_wait", timeout_s_);
        } else {
            for (int l = 0; l < L_; ++l) {
                read_residency(l);
                missing_.clear();
                for (uint32_t b = 0; b < nb_; ++b)
                    if (!resident(b)) missing_.push_back(b);
                if (missing_.empty()) continue;
                if (pol_.before_fetch) pol_.before_fetch();
                check(sg_transfer_fetch(x_, uint32_t(l), missing_.data(), missing_.size()), "sg_transfer_fetch");
                check_wait(sg_transfer_wait_blocks(x_, uint32_t(l), missing_.data(), missing_.size(), timeout_ns_),
                           "sg_transfer_wait_blocks", timeout_s_);
            }
        }
        complete_wait_ns += now_ns() - t;
    }

    size_t digest_floats() const { return digest_floats_; }
    // Emulated runs: selections taken from SelectionAhead, and those it had not computed in time
    // (computed here instead, their CPU time in selector_ns and in the step).
    uint64_t ahead_taken = 0, ahead_late = 0;
    uint64_t essential_wait_ns = 0, selector_ns = 0, fetch_wait_ns = 0, complete_wait_ns = 0, pset_wait_ns = 0;
    uint64_t fetch_calls = 0, fetched_blocks = 0, dropped_blocks = 0, attended_blocks = 0, layer_steps = 0;
    uint64_t selected = 0, selected_in_p = 0;
    // P over all layers (blocks), the largest attended set of one layer at one sparse step, the
    // decode-side profile's largest per-head budget (blocks), and P's blocks that were not resident at
    // SG_LAYER_ESSENTIAL (--attend budget: 0 unless the prefill side's copy of the selection differs
    // from the runtime's; they are then fetched on demand, or dropped without the on-demand path).
    uint64_t proactive_blocks = 0, proactive_layers = 0, attended_max = 0, budget_blocks = 0, proactive_missing = 0;
    // seamless: layers attended whole because every block was here, or because their rest arrived
    // sooner than a selection would take (waited for: seamless_waited, seamless_wait_ns).
    uint64_t whole_layers = 0, seamless_waited = 0, seamless_wait_ns = 0;
    // prefetch: requests and blocks asked for; in the layers a prediction ran for, selected blocks that
    // had been predicted (hits) and missing ones that had not (misses, fetched on demand); predicted
    // blocks the step did not select (unused by that step: with the speculative path on they are sent
    // earlier, not twice); CPU time of the predictions.
    uint64_t prefetch_calls = 0, prefetch_blocks = 0, prefetch_hits = 0, prefetch_misses = 0, prefetch_wasted = 0,
             prefetch_ns = 0;

  private:
    // seamless: whether layer l is attended whole at this step (waiting for its rest if that is the
    // cheaper way).
    bool attend_whole(int l) {
        if (layer_ready(l)) {
            whole_layers += 1;
            return true;
        }
        if (!layer_select_ns_ || !pol_.block_bytes) return false;  // no measured selection cost yet
        read_residency(l);
        uint64_t missing = 0;
        for (uint32_t b = 0; b < nb_; ++b) missing += !resident(b);
        const double rate = receive_rate();  // bytes per ns
        if (!(rate > 0)) return false;
        // Waiting costs the time the rest needs to arrive; selecting costs the selection and, for a
        // layer that misses blocks, a fetch (the recent fetches' mean wait).
        const double due_ns = double(missing * pol_.block_bytes) / rate;
        if (due_ns >= double(layer_select_ns_ + layer_fetch_ns_)) return false;
        // Never longer than selecting and fetching would take: the estimate can be wrong (a pause of
        // the background path, a rate measured before the link filled), and a wait that overruns it
        // then costs at most twice what the selection would have.
        const uint64_t t = now_ns();
        const sg_status_t st = sg_transfer_wait_layer(x_, uint32_t(l), layer_select_ns_ + layer_fetch_ns_);
        seamless_wait_ns += now_ns() - t;
        if (st != SG_OK) {
            if (st != SG_ERR_TIMEOUT) check(st, "sg_transfer_wait_layer");
            return false;
        }
        whole_layers += 1;
        seamless_waited += 1;
        return true;
    }
    bool layer_ready(int l) {
        uint32_t state = 0;
        check(sg_transfer_layer_state(x_, uint32_t(l), &state), "sg_transfer_layer_state");
        return (state & SG_LAYER_READY) != 0;
    }
    void wait_arriving(int l, const std::vector<uint32_t>& blocks) {
        if (blocks.empty()) return;
        const uint64_t t = now_ns();
        check_wait(sg_transfer_wait_blocks(x_, uint32_t(l), blocks.data(), blocks.size(), timeout_ns_),
                   "sg_transfer_wait_blocks", timeout_s_);
        const uint64_t took = now_ns() - t;
        fetch_wait_ns += took;
        layer_fetch_ns_ = layer_fetch_ns_ ? (3 * layer_fetch_ns_ + took) / 4 : took;
    }
    // The receive rate, from the transfer's byte count over the last 5-100 ms.
    void note_received() {
        sg_transfer_stats_t st;
        sg_transfer_stats_init(&st);
        if (sg_transfer_stats(x_, &st) != SG_OK) return;
        const uint64_t t = now_ns();
        samples_.push_back({t, st.bytes});
        while (samples_.size() > 2 && t - samples_[1].first > 100000000ull) samples_.pop_front();
    }
    double receive_rate() const {
        if (samples_.size() < 2) return 0;
        const auto& a = samples_.front();
        const auto& b = samples_.back();
        if (b.first - a.first < 5000000ull || b.second <= a.second) return 0;
        return double(b.second - a.second) / double(b.first - a.first);
    }
    // P (see the class comment) once the layer's essential blocks are here; the digests.
    void take_layer(int l) {
        std::vector<uint32_t>& P = P_[size_t(l)];
        read_residency(l);
        if (psets_) {
            const uint64_t t = now_ns();
            while (!psets_->complete(uint32_t(l))) pump_();
            pset_wait_ns += now_ns() - t;
            P = psets_->blocks(uint32_t(l));
            missing_.clear();
            for (uint32_t b : P)
                if (!resident(b)) missing_.push_back(b);
            proactive_missing += missing_.size();
            if (!missing_.empty() && pol_.on_demand) {
                if (pol_.before_fetch) pol_.before_fetch();
                check(sg_transfer_fetch(x_, uint32_t(l), missing_.data(), missing_.size()), "sg_transfer_fetch");
                check_wait(sg_transfer_wait_blocks(x_, uint32_t(l), missing_.data(), missing_.size(), timeout_ns_),
                           "sg_transfer_wait_blocks", timeout_s_);
            } else if (!missing_.empty()) {
                std::erase_if(P, [&](uint32_t b) { return !resident(b); });
            }
        } else {
            for (uint32_t b = 0; b < nb_; ++b)
                if (resident(b)) P.push_back(b);
        }
        proactive_blocks += P.size();
        proactive_layers += 1;
        // A layer already whole is attended whole (seamless), so its digests are read only if a
        // selection asks for them (select() loads them then): the runtime computes a whole layer's
        // digests only on demand.
        if (!pol_.seamless || !layer_ready(l)) digests(l);
        have_[size_t(l)] = 1;
    }
    void read_residency(int l) {
        size_t bits = 0;
        check(sg_transfer_residency(x_, uint32_t(l), bitmap_.data(), bitmap_.size(), &bits), "sg_transfer_residency");
    }
    bool resident(uint32_t b) const { return (bitmap_[b / 8] >> (b % 8)) & 1u; }
    const float* digests(int l) {
        std::vector<float>& d = cache_digests_ ? digests_[size_t(l)] : scratch_;
        if (!cache_digests_ || !digests_loaded_[size_t(l)]) {
            d.resize(digest_floats_);
            size_t n = 0;
            check(sg_transfer_digests(x_, uint32_t(l), d.data(), d.size(), &n), "sg_transfer_digests");
            digests_loaded_[size_t(l)] = 1;
        }
        return d.data();
    }

    sg_transfer_t x_;
    sg_selector_t sel_;
    int L_, H_;
    uint32_t nb_;
    SparsePolicies pol_;
    uint64_t timeout_ns_;
    int timeout_s_;
    const ProactiveSets* psets_;
    std::function<void()> pump_;
    size_t digest_floats_ = 0;
    bool cache_digests_ = true;
    uint64_t layer_select_ns_ = 0;  // recent selection time of one layer (moving average, or modelled)
    const bool check_ahead_ = SelectionAhead::check_requested();
    std::vector<uint32_t> ahead_blocks_, check_blocks_;
    uint64_t layer_fetch_ns_ = 0;   // recent wait for one layer's fetched blocks (moving average)
    std::deque<std::pair<uint64_t, uint64_t>> samples_;  // (time, bytes received)
    std::vector<uint8_t> have_;
    std::vector<std::vector<uint32_t>> P_;
    std::vector<std::vector<float>> digests_, prev_q_;
    std::vector<std::vector<uint32_t>> prefetched_, arriving_;  // per layer, this step's
    std::vector<uint8_t> predicted_;                            // per layer: predicted this step
    std::vector<uint8_t> digests_loaded_;                       // per layer: digests_ holds them
    std::vector<float> scratch_;
    std::vector<uint8_t> bitmap_;
    std::vector<uint32_t> S_, W_, missing_, need_, out_;
};

// The profile JSONs of --budget (docs/profiles.md), budget per KV head as given: the prefill side's for
// P (policy --proactive-policy, sinks and recent one block each) and the decode side's for S_t (policy
// quest: decode has the digests, not the keys; no sinks or recent, which P already holds, so the whole
// budget goes to scored blocks). quality.cpp's budget_profile is the same; docs/quality.md measures them.
std::string budget_profile_json(const Options& o, const std::string& model, int layers, int kv_heads,
                                const std::string& policy, bool sinks_and_recent) {
    const std::string budget = o.budget.is_fraction ? fmt("{\"fraction\": %.17g}", o.budget.fraction)
                                                    : fmt("{\"tokens\": %llu}", (unsigned long long)o.budget.tokens);
    const int edge = sinks_and_recent ? o.block_tokens : 0;
    return fmt(
        "{\"version\": 1, \"model\": \"%s\", \"num_layers\": %d, \"num_kv_heads\": %d, \"block_tokens\": %d, "
        "\"defaults\": {\"policy\": \"%s\", \"budget\": %s, \"sinks\": %d, \"recent\": %d}}",
        model.c_str(), layers, kv_heads, o.block_tokens, policy.c_str(), budget.c_str(), edge, edge);
}

// ---- results ---------------------------------------------------------------------------------------

struct Results {
    std::string mode, model, provider = "none", profile;
    bool emulated = false, full_stream = false, on_demand = false, speculative = false;
    Attend attend = Attend::kBudget;
    uint32_t paths = 0;
    uint64_t prompt_tokens = 0;
    int new_tokens = 0, block_tokens = 0, sparse_steps_asked = -1;
    uint32_t kv_dtype = 0;
    std::vector<int> tokens;
    uint64_t t0 = 0, t1 = 0, t2 = 0, tlast = 0;
    uint64_t ahead_cpu_ns = 0, ahead_taken = 0, ahead_late = 0;  // emulated selective runs (select_ahead.hpp)
    // Decode's steps after step 2, sparse and dense (their time and count), and the 64th token's time.
    uint64_t t64 = 0, sparse_later_ns = 0, sparse_later_n = 0, dense_later_ns = 0, dense_later_n = 0;
    uint64_t cold_ns = 0, decode_cold_ns = 0, prefill_ns = 0;
    // decode side
    uint64_t first_wait_ns = 0, step1_ns = 0, selector_ns = 0, fetch_wait_ns = 0, essential_wait_ns = 0,
             pset_wait_ns = 0, complete_wait_ns = 0, sparse_steps = 0, attended_blocks = 0, layer_steps = 0,
             fetch_calls = 0, fetched_blocks = 0, dropped_blocks = 0, selected = 0, selected_in_p = 0,
             proactive_blocks = 0, proactive_layers = 0, attended_max = 0, budget_blocks = 0, proactive_missing = 0;
    // The stall's parts (decode side's clock; CLOCK_MONOTONIC is one clock for both processes):
    // FIRST's arrival after t1, and step 2's selector time, on-demand wait and fetch calls.
    uint64_t first_recv = 0, step2_selector_ns = 0, step2_fetch_wait_ns = 0, step2_fetch_calls = 0;
    uint64_t digest_floats = 0;  // one layer's digests as the decode side's selector reads them (fp32)
    bool seamless = true, parallel = true, prefetch = true;
    // seamless: layers attended whole (all steps, step 2), of them waited for; prefetch (SparseDecoder)
    uint64_t whole_layers = 0, step2_whole_layers = 0, seamless_waited = 0, seamless_wait_ns = 0;
    uint64_t prefetch_calls = 0, prefetch_blocks = 0, prefetch_hits = 0, prefetch_misses = 0, prefetch_wasted = 0,
             prefetch_ns = 0, block_bytes = 0;
    uint64_t mirror_ns = 0;  // prefill side, --attend budget: making P again for PSET (its own thread, not in TTFT)
    // sg_transfer_stats of the decode side (what had arrived by the last token) and of the prefill side
    uint64_t bytes = 0, bytes_full = 0, bytes_proactive = 0, bytes_on_demand = 0, bytes_speculative = 0,
             digest_bytes = 0, fetch_requests = 0, fetch_blocks = 0, staged_bytes = 0, rma_ops = 0;
    uint32_t wire_quant = 0;  // --wire-quant
    uint64_t quantized_bytes = 0, quantized_wire_bytes = 0;
    long rss_prefill_kb = 0, rss_decode_kb = 0;
    uint64_t prompt_blocks = 0;
    uint64_t kv_bytes = 0;  // the prompt's whole KV cache (K and V, every layer): what SG_PATH_FULL moves
    // emulation
    EmuParams emu;
    int emu_patterns = 0;
    double emu_alpha = 0, emu_sigma = 0, emu_mass_measured = 0, emu_prefill_layer_ms = 0, emu_decode_weights_ms = 0;
};

// What an emulated step 2 is charged for selection when every layer is selected: per layer one scan of
// its digests (fp32, as the selector reads them) at decode_tbps plus the kernels' launches
// (SelectionCost, the same figure EmuCompute::step charges). The CPU's own time is reported beside.
double modelled_selection_ms(const Results& r) {
    const EmuShape* shape = find_emu_shape(r.emu.name);
    if (!shape || !r.digest_floats || !(r.emu.tbps > 0)) return NAN;
    return 1e3 * double(shape->layers) * SelectionCost().select_s(double(r.digest_floats) * 4.0, r.emu.tbps * 1e12);
}

// The one device model of an emulated run, as the JSON and the text report name it.
std::string device_model_label(const Results& r) {
    return fmt("modelled accelerator: prefill %.0f TFLOP/s, decode %.1f TB/s, %.0f us a kernel launch; "
               "attention, selection (digest scan, scores, top-k) and merge charged to it, this CPU's "
               "selection time reported beside (selector_cpu_ms); transfers real",
               r.emu.tflops, r.emu.tbps, SelectionCost::kLaunchS * 1e6);
}

std::string json_str(const std::string& s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\')
            o += '\\', o += c;
        else if (static_cast<unsigned char>(c) < 0x20)
            o += fmt("\\u%04x", c);
        else
            o += c;
    }
    return o + "\"";
}

std::string num(double v) { return std::isfinite(v) ? fmt("%.6g", v) : "null"; }

void print_results(const Results& r, bool json) {
    const bool has2 = r.new_tokens >= 2 && r.t2 != 0;
    const double ttft = ms(r.t1 - r.t0);
    const double ttst = has2 ? ms(r.t2 - r.t0) : NAN;
    const double stall = has2 ? ttst - ttft : NAN;
    const double tpot = r.new_tokens > 2 ? ms(r.tlast - r.t2) / double(r.new_tokens - 2) : NAN;
    const double attended_frac =
        r.layer_steps && r.prompt_blocks ? double(r.attended_blocks) / double(r.layer_steps * r.prompt_blocks) : NAN;
    const double attended_max_frac =
        r.layer_steps && r.prompt_blocks ? double(r.attended_max) / double(r.prompt_blocks) : NAN;
    const double proactive_frac = r.proactive_layers && r.prompt_blocks
                                      ? double(r.proactive_blocks) / double(r.proactive_layers * r.prompt_blocks)
                                      : NAN;
    // Every byte the transfer moved (KV of every path and the page digests) over the prompt's whole KV.
    const double bytes_of_kv = r.kv_bytes ? double(r.bytes) / double(r.kv_bytes) : NAN;
    if (json) {
        std::vector<std::pair<std::string, std::string>> f;
        f.emplace_back("mode", json_str(r.mode));
        f.emplace_back("emulated", r.emulated ? "true" : "false");
        f.emplace_back("model", json_str(r.model));
        f.emplace_back("provider", json_str(r.provider));
        std::string toks = "[";  // emulated runs have no real tokens: []
        for (size_t i = 0; i < r.tokens.size() && !r.emulated; ++i)
            toks += (i ? "," : "") + std::to_string(r.tokens[i]);
        f.emplace_back("tokens", toks + "]");
        f.emplace_back("prompt_tokens", std::to_string(r.prompt_tokens));
        f.emplace_back("new_tokens", std::to_string(r.new_tokens));
        f.emplace_back("block_tokens", std::to_string(r.block_tokens));
        f.emplace_back("kv_dtype", json_str(dtype_label(r.kv_dtype)));
        f.emplace_back("cold_start_ms", num(ms(r.cold_ns)));
        f.emplace_back("decode_cold_start_ms", num(ms(r.decode_cold_ns)));
        f.emplace_back("ttft_ms", num(ttft));
        f.emplace_back("ttst_ms", num(ttst));
        f.emplace_back("stall_ms", num(stall));
        f.emplace_back("tpot_ms", num(tpot));
        // The whole response: t0 -> the last of new_tokens tokens, and -> the 64th; the time per token
        // after the second, of the steps that attended sparse and of those that attended whole.
        f.emplace_back("e2e_ms", num(r.new_tokens >= 2 && r.tlast ? ms(r.tlast - r.t0) : NAN));
        f.emplace_back("e2e_64_ms", num(r.t64 ? ms(r.t64 - r.t0) : NAN));
        f.emplace_back("tpot_sparse_ms",
                       num(r.sparse_later_n ? ms(r.sparse_later_ns) / double(r.sparse_later_n) : NAN));
        f.emplace_back("tpot_dense_ms", num(r.dense_later_n ? ms(r.dense_later_ns) / double(r.dense_later_n) : NAN));
        f.emplace_back("prefill_ms", num(ms(r.prefill_ns)));
        if (r.mode != "colocated") {
            f.emplace_back("paths", std::to_string(r.paths));
            if (r.mode == "full") f.emplace_back("full_stream", r.full_stream ? "true" : "false");
            f.emplace_back("kv_bytes", std::to_string(r.kv_bytes));
            f.emplace_back("bytes", std::to_string(r.bytes));  // every path's KV and the digests
            f.emplace_back("bytes_of_kv", num(bytes_of_kv));
            f.emplace_back("bytes_full", std::to_string(r.bytes_full));
            f.emplace_back("bytes_proactive", std::to_string(r.bytes_proactive));
            f.emplace_back("bytes_on_demand", std::to_string(r.bytes_on_demand));
            f.emplace_back("bytes_speculative", std::to_string(r.bytes_speculative));
            f.emplace_back("digest_bytes", std::to_string(r.digest_bytes));
            f.emplace_back("fetches", std::to_string(r.fetch_requests));
            f.emplace_back("fetch_blocks", std::to_string(r.fetch_blocks));
            f.emplace_back("staged_bytes", std::to_string(r.staged_bytes));
            f.emplace_back("wire_quant", json_str(wire_quant_name(r.wire_quant)));
            f.emplace_back("quantized_bytes", std::to_string(r.quantized_bytes));
            f.emplace_back("quantized_wire_bytes", std::to_string(r.quantized_wire_bytes));
            f.emplace_back("rma_ops", std::to_string(r.rma_ops));
            f.emplace_back("first_step_wait_ms", num(ms(r.first_wait_ns)));
            f.emplace_back("stall_first_message_ms", num(ms(r.first_recv - std::min(r.first_recv, r.t1))));
            f.emplace_back("stall_selector_ms", num(ms(r.step2_selector_ns)));
            f.emplace_back("stall_fetch_wait_ms", num(ms(r.step2_fetch_wait_ns)));
            f.emplace_back("stall_fetch_calls", std::to_string(r.step2_fetch_calls));
            f.emplace_back("rss_prefill_mib", num(double(r.rss_prefill_kb) / 1024.0));
            f.emplace_back("rss_decode_mib", num(double(r.rss_decode_kb) / 1024.0));
        }
        if (r.mode == "selective") {
            f.emplace_back("profile", json_str(r.profile));
            f.emplace_back("on_demand", r.on_demand ? "true" : "false");
            f.emplace_back("speculative", r.speculative ? "true" : "false");
            f.emplace_back("attend", json_str(attend_name(r.attend)));
            f.emplace_back("sparse_steps", std::to_string(r.sparse_steps));
            f.emplace_back("prompt_blocks", std::to_string(r.prompt_blocks));
            f.emplace_back("budget_blocks", std::to_string(r.budget_blocks));
            f.emplace_back("proactive_fraction", num(proactive_frac));
            f.emplace_back("proactive_missing_blocks", std::to_string(r.proactive_missing));
            f.emplace_back("proactive_copy_ms", num(ms(r.mirror_ns)));
            f.emplace_back("proactive_set_wait_ms", num(ms(r.pset_wait_ns)));
            f.emplace_back("essential_wait_ms", num(ms(r.essential_wait_ns)));
            f.emplace_back("selector_ms", num(ms(r.selector_ns)));
            f.emplace_back("fetch_wait_ms", num(ms(r.fetch_wait_ns)));
            f.emplace_back("complete_wait_ms", num(ms(r.complete_wait_ns)));
            f.emplace_back("fetch_calls", std::to_string(r.fetch_calls));
            f.emplace_back("fetched_blocks", std::to_string(r.fetched_blocks));
            f.emplace_back("dropped_blocks", std::to_string(r.dropped_blocks));
            f.emplace_back("attended_fraction", num(attended_frac));
            f.emplace_back("attended_max_blocks", std::to_string(r.attended_max));
            f.emplace_back("attended_max_fraction", num(attended_max_frac));
            f.emplace_back("selected_in_proactive",
                           num(r.selected ? double(r.selected_in_p) / double(r.selected) : NAN));
            f.emplace_back("seamless", r.seamless ? "true" : "false");
            f.emplace_back("parallel", r.parallel ? "true" : "false");
            f.emplace_back("prefetch", r.prefetch ? "true" : "false");
            // seamless: layer steps attended whole (every block here, or waited for because the rest
            // arrived sooner than a selection would take), in all and in step 2
            f.emplace_back("whole_layer_steps", std::to_string(r.whole_layers));
            f.emplace_back("step2_whole_layers", std::to_string(r.step2_whole_layers));
            f.emplace_back("seamless_waited_layers", std::to_string(r.seamless_waited));
            f.emplace_back("seamless_wait_ms", num(ms(r.seamless_wait_ns)));
            f.emplace_back("prefetch_calls", std::to_string(r.prefetch_calls));
            f.emplace_back("prefetch_blocks", std::to_string(r.prefetch_blocks));
            f.emplace_back("prefetch_hits", std::to_string(r.prefetch_hits));
            f.emplace_back("prefetch_misses", std::to_string(r.prefetch_misses));
            // hit rate: selected blocks that were predicted over those predicted or fetched on demand
            f.emplace_back("prefetch_hit_rate",
                           num(r.prefetch_hits + r.prefetch_misses
                                   ? double(r.prefetch_hits) / double(r.prefetch_hits + r.prefetch_misses)
                                   : NAN));
            f.emplace_back("prefetch_unused_bytes", std::to_string(r.prefetch_wasted * r.block_bytes));
            f.emplace_back("prefetch_predict_ms", num(ms(r.prefetch_ns)));
        }
        if (r.emulated) {
            f.emplace_back("emulate_tokens", std::to_string(r.emu.tokens));
            f.emplace_back("prefill_tflops", num(r.emu.tflops));
            f.emplace_back("decode_tbps", num(r.emu.tbps));
            f.emplace_back("mass", num(r.emu.mass));
            f.emplace_back("mass_measured", num(r.emu_mass_measured));
            f.emplace_back("overlap", num(r.emu.overlap));
            f.emplace_back("seed", std::to_string(r.emu.seed));
            f.emplace_back("key_patterns", std::to_string(r.emu_patterns));
            f.emplace_back("key_alpha", num(r.emu_alpha));
            f.emplace_back("key_sigma", num(r.emu_sigma));
            f.emplace_back("model_prefill_layer_ms", num(r.emu_prefill_layer_ms));
            f.emplace_back("model_decode_weights_ms", num(r.emu_decode_weights_ms));
            f.emplace_back("device_model", json_str(device_model_label(r)));
            if (r.mode == "selective" && r.digest_floats) {
                // Step 2's selection as charged to the modelled device (every layer selected), and
                // the CPU's: the selections computed ahead on their own thread (select_ahead.hpp),
                // and those computed inline because they were not ready (their time is in the step).
                f.emplace_back("stall_selector_modelled_ms", num(modelled_selection_ms(r)));
                f.emplace_back("selector_cpu_ms", num(ms(r.selector_ns + r.ahead_cpu_ns)));
                f.emplace_back("selector_ahead_cpu_ms", num(ms(r.ahead_cpu_ns)));
                f.emplace_back("selections_ahead", std::to_string(r.ahead_taken));
                f.emplace_back("selections_late", std::to_string(r.ahead_late));
            }
            f.emplace_back("compute_model",
                           json_str("prefill layer = (2*params_per_layer*N + 2*n_heads*head_dim*N^2)/prefill_rate; "
                                    "decode step = (2*(params_of_all_layers + vocab*dim) + attended_tokens*"
                                    "kv_bytes_per_token)/bandwidth + measured selector time"));
        }
        std::string out = "{";
        for (size_t i = 0; i < f.size(); ++i) out += (i ? ", " : "") + json_str(f[i].first) + ": " + f[i].second;
        std::printf("%s}\n", out.c_str());
        return;
    }

    std::printf("smartgen-disagg  mode %s%s%s\n", r.mode.c_str(),
                r.mode == "full" ? (r.full_stream ? " (layers streamed during prefill)" : " (sent after prefill)") : "",
                r.emulated ? "  [EMULATED: compute time modelled, transfers real]" : "");
    std::printf("  model            %s\n", r.model.c_str());
    std::printf("  prompt           %llu tokens, %d new tokens, KV %s, %d tokens per block\n",
                (unsigned long long)r.prompt_tokens, r.new_tokens, dtype_label(r.kv_dtype), r.block_tokens);
    if (r.mode != "colocated") std::printf("  provider         %s\n", r.provider.c_str());
    if (r.emulated) {
        std::printf("  accelerator      %.4g TFLOP/s effective for prefill, %.4g TB/s for decode\n", r.emu.tflops,
                    r.emu.tbps);
        std::printf(
            "  compute model    prefill layer = (2*params_per_layer*N + 2*n_heads*head_dim*N^2) / rate"
            " = %.3f ms\n",
            r.emu_prefill_layer_ms);
        std::printf(
            "                   decode step = (2*(params + vocab*dim) + attended KV bytes) / bandwidth"
            " (weights %.3f ms) + measured selector time\n",
            r.emu_decode_weights_ms);
        std::printf(
            "  synthetic keys   mass %.3g in the top 1/8 of blocks (measured %.3f), overlap %.3g, seed %llu,"
            " alpha %.3g, sigma %.3g, %d pattern(s)\n",
            r.emu.mass, r.emu_mass_measured, r.emu.overlap, (unsigned long long)r.emu.seed, r.emu_alpha, r.emu_sigma,
            r.emu_patterns);
    }
    if (r.mode == "selective")
        std::printf(
            "  selective        profile %s; on-demand %s, speculative %s, attend %s; %llu of %d decode step(s)"
            " sparse\n",
            r.profile.c_str(), r.on_demand ? "on" : "off", r.speculative ? "on" : "off", attend_name(r.attend),
            (unsigned long long)r.sparse_steps, std::max(r.new_tokens - 1, 0));
    std::printf("\n  %-30s %12s\n", "", "ms");
    std::printf("  %-30s %12.3f\n", "cold start (not in TTFT)", ms(r.cold_ns));
    std::printf("  %-30s %12.3f\n", "TTFT (prefill, first token)", ttft);
    std::printf("  %-30s %12.3f\n", "TTST (second token)", ttst);
    std::printf("  %-30s %12.3f\n", "stall (TTST - TTFT)", stall);
    std::printf("  %-30s %12.4f\n", "TPOT (after the second token)", tpot);
    if (r.mode != "colocated") {
        std::printf("  %-30s %12.3f\n", "decode waited in step 2", ms(r.first_wait_ns));
        if (r.mode == "selective") {
            std::printf("  %-30s %12.3f\n", "  token 1 reached decode", ms(r.first_recv - std::min(r.first_recv, r.t1)));
            std::printf("  %-30s %12.3f\n", "  step 2's selector", ms(r.step2_selector_ns));
            std::printf("  %-30s %12.3f\n", "  step 2's on-demand waits", ms(r.step2_fetch_wait_ns));
            if (r.emulated)
                std::printf("  %-30s %12.3f  (%llu taken ahead, %llu late)\n", "selector CPU, ahead thread",
                            ms(r.ahead_cpu_ns), (unsigned long long)r.ahead_taken,
                            (unsigned long long)r.ahead_late);
            std::printf("  %-30s %12.3f\n", "selector (all steps)", ms(r.selector_ns));
            std::printf("  %-30s %12.3f\n", "on-demand waits", ms(r.fetch_wait_ns));
            if (r.attend == Attend::kBudget)
                std::printf("  %-30s %12.3f\n", "waiting for PSET (P's list)", ms(r.pset_wait_ns));
            std::printf("  %-30s %12.3f\n", "waiting for the rest", ms(r.complete_wait_ns));
        }
        std::printf(
            "\n  bytes            %llu in all, %.1f%% of the prompt's KV (%llu): full %llu, proactive %llu,"
            " on-demand %llu, speculative %llu, digests %llu (decode side, by the last token)\n",
            (unsigned long long)r.bytes, 100.0 * bytes_of_kv, (unsigned long long)r.kv_bytes,
            (unsigned long long)r.bytes_full, (unsigned long long)r.bytes_proactive,
            (unsigned long long)r.bytes_on_demand, (unsigned long long)r.bytes_speculative,
            (unsigned long long)r.digest_bytes);
        std::printf("  fetches          %llu requests, %llu blocks\n", (unsigned long long)r.fetch_requests,
                    (unsigned long long)r.fetch_blocks);
        if (r.mode == "selective") {
            std::printf("  P                %.1f%% of the prompt blocks per layer (attend %s)%s\n",
                        100.0 * proactive_frac, attend_name(r.attend),
                        r.proactive_missing ? fmt("; %llu of its blocks were not resident at SG_LAYER_ESSENTIAL",
                                                  (unsigned long long)r.proactive_missing)
                                                  .c_str()
                                            : "");
            if (r.sparse_steps)
                std::printf(
                    "  attended         %.1f%% of the prompt blocks per layer and sparse step (at most %llu of %llu);"
                    " %.1f%% of the selected blocks were proactive\n",
                    100.0 * attended_frac, (unsigned long long)r.attended_max, (unsigned long long)r.prompt_blocks,
                    r.selected ? 100.0 * double(r.selected_in_p) / double(r.selected) : 0.0);
            else
                std::printf("  attended         no sparse step: every decode step attended to the whole prompt\n");
        }
        std::printf("  resident memory  prefill %.0f MiB, decode %.0f MiB (peak)\n", double(r.rss_prefill_kb) / 1024.0,
                    double(r.rss_decode_kb) / 1024.0);
    }
    if (!r.emulated) {
        std::printf("\n  tokens          ");
        for (int t : r.tokens) std::printf(" %d", t);
        std::printf("\n");
    }
}

// ---- prompt -----------------------------------------------------------------------------------------

// The built-in prompt: BOS, then 99 tokens stories260K sampled from BOS at temperature 1 (tokens 0..2
// excluded) with seed 260: `smartgen-disagg --make-prompt 100 --seed 260` prints it again.
const int kDefaultPrompt[] = {1,   461, 461, 461, 447, 430, 427, 339, 424, 304, 264, 288, 283, 466, 465, 466, 396,
                              397, 422, 422, 473, 473, 149, 147, 39,  177, 178, 36,  52,  57,  480, 326, 266, 266,
                              277, 455, 362, 430, 13,  477, 310, 341, 447, 416, 406, 290, 466, 84,  52,  140, 470,
                              54,  448, 295, 188, 502, 39,  4,   405, 356, 473, 82,  115, 173, 367, 367, 367, 367,
                              367, 367, 367, 367, 367, 367, 367, 367, 367, 367, 463, 463, 458, 458, 458, 477, 477,
                              477, 477, 477, 388, 329, 390, 448, 316, 285, 330, 404, 351, 304, 418, 390};

std::vector<int> sample_prompt(const Model& m, int n, uint64_t seed) {
    const Config& c = m.config();
    if (n > c.seq_len) throw UsageError(fmt("--make-prompt: %d tokens, the model takes at most %d", n, c.seq_len));
    KvPoolStorage pool(c, 16, blocks_for(n, 16));
    const std::vector<uint32_t> table = identity_table(blocks_for(n, 16));
    RunState st(c);
    std::vector<int> p{1};
    std::span<const float> logits = prefill(m, pool.view(), table, p, st);
    uint64_t s = seed;
    while (int(p.size()) < n) {
        float mx = -INFINITY;
        for (int i = 3; i < c.vocab_size; ++i) mx = std::max(mx, logits[size_t(i)]);
        double sum = 0;
        std::vector<double> pr(size_t(c.vocab_size), 0.0);
        for (int i = 3; i < c.vocab_size; ++i) sum += pr[size_t(i)] = std::exp(double(logits[size_t(i)] - mx));
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        double r = double(z >> 11) / 9007199254740992.0 * sum;
        int tok = c.vocab_size - 1;
        for (int i = 3; i < c.vocab_size; ++i) {
            r -= pr[size_t(i)];
            if (r < 0) {
                tok = i;
                break;
            }
        }
        p.push_back(tok);
        if (int(p.size()) < n) logits = decode_step(m, pool.view(), table, int(p.size()) - 1, tok, st);
    }
    return p;
}

// --model, else $SMARTGEN_MODEL, else $SMARTGEN_MODEL_DIR or the source tree's examples/models, else
// examples/models from the working directory (an installed binary run in a clone). Returns "" with
// `tried` filled when none exists.
std::string resolve_model(const Options& o, std::string& tried) {
    std::vector<std::string> c;
    if (!o.model.empty()) {
        c.push_back(o.model);
    } else {
        c.push_back(model_files::stories());
        if (!std::getenv("SMARTGEN_MODEL")) c.push_back("examples/models/stories260K.bin");
    }
    for (const std::string& p : c) {
        if (model_files::exists(p)) return p;
        tried += (tried.empty() ? "" : ", ") + p;
    }
    return "";
}

// Thrown when the checkpoint is missing; main_impl turns it into exit 77 (1 under SMARTGEN_REQUIRE_DATA=1).
struct ModelMissing : Fatal {
    using Fatal::Fatal;
};

// The checkpoint resolve_model finds, loaded (its path in *path), or ModelMissing with every path tried.
std::unique_ptr<Model> load_model(const Options& o, std::string* loaded_path = nullptr) {
    std::string tried;
    const std::string path = resolve_model(o, tried);
    if (loaded_path) *loaded_path = path;
    if (path.empty())
        throw ModelMissing(fmt("model file not found (tried %s); give --model PATH, or %s", tried.c_str(),
                               model_files::how_to_point()));
    return std::make_unique<Model>(Model::load(path));
}

// ---- colocated --------------------------------------------------------------------------------------

Results run_colocated(const Options& o, const Model& m, const std::vector<int>& prompt, const std::string& label) {
    Results r;
    r.mode = "colocated";
    r.model = label;
    r.prompt_tokens = prompt.size();
    r.new_tokens = o.max_new_tokens;
    r.block_tokens = o.block_tokens;
    r.kv_dtype = o.kv_dtype;
    const uint64_t c0 = now_ns();
    ModelCompute mc(m, prompt);
    mc.make_pool(false, prompt.size(), o.max_new_tokens, o.block_tokens, KvDtype(o.kv_dtype));
    r.t0 = now_ns();
    r.cold_ns = r.t0 - c0;
    r.tokens.push_back(mc.prefill(0, [](int, const float*, int) {}));
    r.t1 = now_ns();
    r.prefill_ns = r.t1 - r.t0;
    for (int i = 1; i < o.max_new_tokens; ++i) {
        r.tokens.push_back(mc.step(int(prompt.size()) + i - 1, r.tokens.back(), nullptr));
        if (i == 1) r.t2 = now_ns();
    }
    r.tlast = now_ns();
    r.rss_prefill_kb = max_rss_kb();
    return r;
}

// ---- prefill side -------------------------------------------------------------------------------------

struct RunSpec {  // what the prefill side decides and tells the decode side (REQ)
    Mode mode = Mode::kFull;
    uint32_t paths = SG_PATH_FULL;
    uint64_t prompt_len = 0;
    int n_new = 0, block = 16, sparse_steps = -1, window = 0;
    uint32_t dtype = 0;
    bool full_stream = true;
    bool seamless = true, parallel = true, prefetch = false;
    uint32_t wire_quant = 0;  // sg_transfer_options_t.wire_quant, both sides
    Attend attend = Attend::kBudget;
    EmuParams emu;  // name empty: the real model
    int layers = 0, kv_heads = 0, head_dim = 0, dim = 0, vocab = 0;
};

// Seamless is for latency: it applies where decode is sparse only until the speculative path has
// delivered everything (the default). Runs that measure sparse decoding itself (--sparse-steps K, or
// the speculative path off) attend to P u S_t u G at every sparse step, as asked.
bool seamless_applies(const RunSpec& s) {
    return s.seamless && (s.paths & SG_PATH_SPECULATIVE) && s.sparse_steps < 0;
}

std::string encode_req(const RunSpec& s) {
    Fields f("REQ");
    f.add("mode", mode_name(s.mode)).add("paths", s.paths).add("prompt", s.prompt_len).add("new", s.n_new);
    f.add("block", s.block).add("dtype", s.dtype).add("sparse", s.sparse_steps).add("window", s.window);
    f.add("stream", int(s.full_stream)).add("attend", attend_name(s.attend)).add("layers", s.layers);
    f.add("kv_heads", s.kv_heads);
    f.add("seamless", int(s.seamless)).add("parallel", int(s.parallel)).add("prefetch", int(s.prefetch));
    f.add("head_dim", s.head_dim).add("dim", s.dim).add("vocab", s.vocab);
    if (s.wire_quant) f.add("wire_quant", s.wire_quant);
    if (!s.emu.name.empty()) {
        f.add("emulate", s.emu.name).add("tokens", s.emu.tokens).add("tflops", s.emu.tflops).add("tbps", s.emu.tbps);
        f.add("mass", s.emu.mass).add("overlap", s.emu.overlap).add("seed", s.emu.seed);
    }
    return f.str();
}

RunSpec decode_req(const Msg& m) {
    RunSpec s;
    const std::string mode = m.s("mode");
    s.mode = mode == "full" ? Mode::kFull : mode == "selective" ? Mode::kSelective : Mode::kColocated;
    if (s.mode == Mode::kColocated) fatal("the prefill side asked for mode '" + mode + "'");
    s.paths = uint32_t(m.u("paths"));
    s.prompt_len = m.u("prompt");
    s.n_new = int(m.i("new"));
    s.block = int(m.i("block"));
    s.dtype = uint32_t(m.u("dtype"));
    s.sparse_steps = int(m.i("sparse"));
    s.window = int(m.i("window"));
    s.full_stream = m.i("stream") != 0;
    s.seamless = !m.has("seamless") || m.i("seamless") != 0;
    s.parallel = !m.has("parallel") || m.i("parallel") != 0;
    s.prefetch = m.has("prefetch") && m.i("prefetch") != 0;
    s.wire_quant = m.has("wire_quant") ? uint32_t(m.u("wire_quant")) : 0u;
    const std::string attend = m.s("attend");
    if (attend != "budget" && attend != "resident") fatal("the prefill side asked for --attend '" + attend + "'");
    s.attend = attend == "budget" ? Attend::kBudget : Attend::kResident;
    s.layers = int(m.i("layers"));
    s.kv_heads = int(m.i("kv_heads"));
    s.head_dim = int(m.i("head_dim"));
    s.dim = int(m.i("dim"));
    s.vocab = int(m.i("vocab"));
    if (m.has("emulate")) {
        s.emu.name = m.s("emulate");
        s.emu.tokens = m.u("tokens");
        s.emu.tflops = m.d("tflops");
        s.emu.tbps = m.d("tbps");
        s.emu.mass = m.d("mass");
        s.emu.overlap = m.d("overlap");
        s.emu.seed = m.u("seed");
    }
    return s;
}

void fill_stats(Results& r, const sg_transfer_stats_t& s) {
    r.bytes = s.bytes;
    r.bytes_full = s.bytes_full;
    r.bytes_proactive = s.bytes_proactive;
    r.bytes_on_demand = s.bytes_on_demand;
    r.bytes_speculative = s.bytes_speculative;
    r.digest_bytes = s.digest_bytes;
    r.fetch_requests = s.fetch_requests;
    r.fetch_blocks = s.fetch_blocks;
    r.staged_bytes = s.staged_bytes;
    r.quantized_bytes = s.quantized_bytes;
    r.quantized_wire_bytes = s.quantized_wire_bytes;
    // A library that predates the per-path counters leaves them 0: a full transfer's bytes are all
    // on the full path.
    if (r.paths == SG_PATH_FULL && r.bytes_full == 0) r.bytes_full = s.bytes;
}

// The prefill side: returns the results it gathered from both sides.
Results run_prefill(const Options& o, Compute& comp, const RunSpec& spec, const std::string& label, int port_fd) {
    g_role = "prefill";
    Results r;
    r.mode = mode_name(spec.mode);
    r.model = label;
    r.emulated = !spec.emu.name.empty();
    r.emu = spec.emu;
    r.prompt_tokens = spec.prompt_len;
    r.new_tokens = spec.n_new;
    r.block_tokens = spec.block;
    r.kv_dtype = spec.dtype;
    r.wire_quant = spec.wire_quant;
    r.paths = spec.paths;
    r.full_stream = spec.full_stream;
    r.on_demand = spec.paths & SG_PATH_ON_DEMAND;
    r.speculative = spec.paths & SG_PATH_SPECULATIVE;
    r.sparse_steps_asked = spec.sparse_steps;
    r.attend = spec.attend;
    r.seamless = seamless_applies(spec);
    r.parallel = spec.parallel;
    r.prefetch = spec.prefetch && o.profile_file.empty();  // the predictor's profile comes from --budget
    r.block_bytes = 2ull * uint64_t(spec.block) * uint64_t(comp.n_kv_heads) * uint64_t(comp.head_dim) *
                    sg_dtype_size(sg_dtype_t(spec.dtype));
    r.prompt_blocks = blocks_for(int(spec.prompt_len), spec.block);
    r.kv_bytes = spec.prompt_len * uint64_t(comp.n_layers) * uint64_t(comp.n_kv_heads) * uint64_t(comp.head_dim) * 2 *
                 sg_dtype_size(sg_dtype_t(spec.dtype));

    // The engine's side is ready before the clock starts: model, prompt, pool memory.
    comp.make_pool(false, spec.prompt_len, spec.n_new, spec.block, KvDtype(spec.dtype));
    if (auto* emu = dynamic_cast<EmuCompute*>(&comp)) {
        r.emu_patterns = emu->patterns();
        r.emu_alpha = emu->keys()->alpha();
        r.emu_sigma = emu->keys()->sigma();
        r.emu_mass_measured = emu->measured_mass();
        r.emu_prefill_layer_ms = emu->model().prefill_layer_s(emu->shape(), spec.prompt_len) * 1e3;
        r.emu_decode_weights_ms = (emu->model().decode_layer_s(emu->shape(), 0) * emu->shape().layers +
                                   emu->model().decode_classifier_s(emu->shape())) *
                                  1e3;
    }

    // Cold start: context, session, registration, the decode side's expect.
    const uint64_t c0 = now_ns();
    Link L;
    std::string host;
    uint16_t port = 0;
    split_host_port(o.listen, "--listen", host, port);
    std::string local = o.local_addr;
    if (local.empty() && host != "0.0.0.0" && host != "::") local = host;
    make_context(L, o, local);
    sg_error_info_t err;
    sg_error_info_init(&err);
    check(sg_listener_create(L.ctx, host.c_str(), port, &L.listener, &err), "sg_listener_create", &err);
    check(sg_listener_port(L.listener, &port), "sg_listener_port");
    if (port_fd >= 0) {
        const unsigned char b[2] = {uint8_t(port >> 8), uint8_t(port & 0xFF)};
        if (write(port_fd, b, 2) != 2) fatal("cannot send the port to the decode process");
        close(port_fd);
    } else {
        std::fprintf(stderr, "[prefill] listening on %s:%u; start the decode side with --role decode --peer %s:%u\n",
                     host.c_str(), unsigned(port), host.c_str(), unsigned(port));
    }
    sg_session_options_t so;
    sg_session_options_init(&so);
    // Accept in short slices, so a decode process that died before connecting is noticed.
    for (const uint64_t deadline = now_ns() + L.timeout_ns();;) {
        sg_error_info_init(&err);
        const sg_status_t st = sg_session_accept(L.listener, &so, 250000000ull, &L.session, &err);
        if (st == SG_OK) break;
        if (st != SG_ERR_TIMEOUT) check(st, "sg_session_accept", &err);
        if (g_child > 0 && g_child_status < 0 && waitpid(g_child, &g_child_status, WNOHANG) == g_child)
            fatal("the decode process exited before it connected");
        if (now_ns() > deadline) fatal(fmt("sg_session_accept: no decode side after %d s (--timeout)", o.timeout_s));
    }
    sg_listener_destroy(L.listener);
    L.listener = nullptr;
    r.provider = session_provider(L);
    register_pool(L, comp.pool);

    sg_transfer_options_t to;
    sg_transfer_options_init(&to);
    to.paths = spec.paths;
    to.wire_quant = spec.wire_quant;
    // --attend budget: the proactive selection made again here, sent to the decode side (proactive_set.hpp).
    std::unique_ptr<ProactiveSender> mirror;
    if (spec.mode == Mode::kSelective) {
        sg_error_info_init(&err);
        // The decode side's profile goes along, in chunks: the file's with --profile, else --budget's
        // decode-side one.
        std::string decode_json;
        if (!o.profile_file.empty()) {
            check(sg_profile_load(o.profile_file.c_str(), &L.profile, &err), "sg_profile_load (--profile)", &err);
            r.profile = o.profile_file;
            size_t len = 0;
            sg_profile_to_json(L.profile, nullptr, 0, &len);
            decode_json.assign(len + 1, '\0');
            check(sg_profile_to_json(L.profile, decode_json.data(), decode_json.size(), &len), "sg_profile_to_json");
            decode_json.resize(len);
        } else {
            const std::string name = label.substr(0, label.find(" ("));
            const std::string policy = proactive_policy_for(o);
            const std::string j = budget_profile_json(o, name, comp.n_layers, comp.n_kv_heads, policy, true);
            check(sg_profile_parse(j.data(), j.size(), &L.profile, &err), "sg_profile_parse (--budget)", &err);
            decode_json = budget_profile_json(o, name, comp.n_layers, comp.n_kv_heads, "quest", false);
            r.profile = o.budget.is_fraction ? fmt("budget %.4g of the tokens", o.budget.fraction)
                                             : fmt("budget %llu tokens", (unsigned long long)o.budget.tokens);
            r.profile += fmt("; P %s, sinks %d, recent %d; S_t quest", policy.c_str(), o.block_tokens, o.block_tokens);
        }
        to.profile = L.profile;
        for (size_t off = 0; off < decode_json.size(); off += 4000) L.notify("PRF " + decode_json.substr(off, 4000));
        if (spec.prefetch && o.profile_file.empty()) {
            // The prefetch predictor's profile: the decode side's with a larger budget, so that the
            // blocks just below the cut (the likeliest to enter the next step's selection) come too.
            Options wide = o;
            if (wide.budget.is_fraction)
                wide.budget.fraction = std::min(1.0, o.prefetch_scale * wide.budget.fraction);
            else
                wide.budget.tokens = uint64_t(std::ceil(o.prefetch_scale * double(wide.budget.tokens)));
            const std::string name = label.substr(0, label.find(" ("));
            const std::string j = budget_profile_json(wide, name, comp.n_layers, comp.n_kv_heads, "quest", false);
            for (size_t off = 0; off < j.size(); off += 4000) L.notify("PRW " + j.substr(off, 4000));
        }
        if (spec.attend == Attend::kBudget)
            mirror = std::make_unique<ProactiveSender>(
                std::make_unique<ProactiveMirror>(L.profile, layout_of(comp.pool), spec.prompt_len, comp.table),
                [&L](const std::string& m) { L.notify(m); });
    }
    L.notify(encode_req(spec));
    // Warm-up: one block of every layer moves once before t0, so the fabric's connection and the
    // registrations are established (a session's first RMA pays for them) and t0 finds them warm.
    {
        sg_transfer_t w = nullptr;
        sg_transfer_options_t wo;
        sg_transfer_options_init(&wo);
        wo.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_error_info_init(&err);
        check(sg_transfer_post(L.session, "warm-up", L.kv, comp.table.data(), 1,
                               std::min<uint64_t>(spec.prompt_len, uint64_t(spec.block)), &wo, &w, &err),
              "sg_transfer_post (warm-up)", &err);
        const sg_status_t st = sg_transfer_wait(w, L.timeout_ns());
        sg_transfer_release(w);
        check_wait(st, "sg_transfer_wait (warm-up)", o.timeout_s);
    }
    const Msg ready = L.expect_msg("READY");
    r.decode_cold_ns = ready.u("cold");
    r.cold_ns = now_ns() - c0;

    // t0: the prompt is here, session and pools are warm.
    const uint64_t t0 = now_ns();
    const bool post_first = spec.mode == Mode::kSelective || spec.full_stream;
    if (post_first) {
        sg_error_info_init(&err);
        const sg_status_t st = sg_transfer_post(L.session, "req-1", L.kv, comp.table.data(), r.prompt_blocks,
                                                spec.prompt_len, &to, &L.xfer, &err);
        if (st == SG_ERR_UNSUPPORTED && spec.mode == Mode::kSelective) {
            // The library in use runs SG_PATH_FULL only: nothing selective can be measured here.
            std::fprintf(stderr, "smartgen-disagg: --mode selective: %s\n", err.message);
            std::fflush(nullptr);
            _exit(77);
        }
        check(st, "sg_transfer_post", &err);
    }
    const int token1 = comp.prefill(spec.mode == Mode::kSelective ? spec.window : 0, [&](int l, const float* q, int W) {
        if (spec.mode == Mode::kFull) {
            if (spec.full_stream)
                check(sg_transfer_layer_written(L.xfer, uint32_t(l), nullptr), "sg_transfer_layer_written");
            return;
        }
        check(sg_transfer_layer_written_q(L.xfer, uint32_t(l), q, uint32_t(W), uint32_t(comp.n_heads)),
              "sg_transfer_layer_written_q");
        if (mirror) mirror->post(uint32_t(l), q, uint32_t(W), uint32_t(comp.n_heads), size_t(comp.head_dim));
    });
    const uint64_t t1 = now_ns();
    L.notify(Fields("FIRST").add("token", token1).add("prompt", spec.prompt_len).add("t0", t0).add("t1", t1).str());
    if (mirror) r.mirror_ns = mirror->finish();  // the last PSET messages may follow FIRST
    if (!post_first) {
        to.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_error_info_init(&err);
        check(sg_transfer_post(L.session, "req-1", L.kv, comp.table.data(), r.prompt_blocks, spec.prompt_len, &to,
                               &L.xfer, &err),
              "sg_transfer_post", &err);
    }
    r.t0 = t0;
    r.t1 = t1;
    r.prefill_ns = t1 - t0;
    r.tokens.push_back(token1);
    if (r.emulated) progress(fmt("first token after %.3f ms; waiting for the decode side", ms(t1 - t0)));

    // The decode side's report.
    const Msg res = L.expect_msg("RES");
    r.t2 = res.u("t2");
    r.tlast = res.u("tlast");
    r.t64 = res.has("t64") ? res.u("t64") : 0;
    r.sparse_later_ns = res.has("sp_ns") ? res.u("sp_ns") : 0;
    r.sparse_later_n = res.has("sp_n") ? res.u("sp_n") : 0;
    r.dense_later_ns = res.has("dn_ns") ? res.u("dn_ns") : 0;
    r.dense_later_n = res.has("dn_n") ? res.u("dn_n") : 0;
    r.first_wait_ns = res.u("first_wait");
    r.first_recv = res.u("first_recv");
    r.step2_selector_ns = res.u("sel2");
    r.step2_fetch_wait_ns = res.u("fetch2");
    r.step2_fetch_calls = res.u("calls2");
    r.digest_floats = res.u("dig_floats");
    r.step2_whole_layers = res.u("whole2");
    if (res.has("whole")) {
        r.whole_layers = res.u("whole");
        r.seamless_waited = res.u("s_waited");
        r.seamless_wait_ns = res.u("s_wait");
        r.prefetch_calls = res.u("pf_calls");
        r.prefetch_blocks = res.u("pf_blocks");
        r.prefetch_hits = res.u("pf_hits");
        r.prefetch_misses = res.u("pf_misses");
        r.prefetch_wasted = res.u("pf_wasted");
        r.prefetch_ns = res.u("pf_ns");
    }
    r.selector_ns = res.u("sel");
    r.ahead_cpu_ns = res.has("ah_cpu") ? res.u("ah_cpu") : 0;
    r.ahead_taken = res.has("ah_taken") ? res.u("ah_taken") : 0;
    r.ahead_late = res.has("ah_late") ? res.u("ah_late") : 0;
    r.fetch_wait_ns = res.u("fetch_wait");
    r.essential_wait_ns = res.u("ess_wait");
    r.pset_wait_ns = res.u("pset_wait");
    r.complete_wait_ns = res.u("complete_wait");
    r.sparse_steps = res.u("sparse_steps");
    r.attended_blocks = res.u("attended");
    r.layer_steps = res.u("layer_steps");
    r.fetch_calls = res.u("fetch_calls");
    r.fetched_blocks = res.u("fetched");
    r.dropped_blocks = res.u("dropped");
    r.selected = res.u("selected");
    r.selected_in_p = res.u("selected_in_p");
    r.proactive_blocks = res.u("p_blocks");
    r.proactive_layers = res.u("p_layers");
    r.proactive_missing = res.u("p_missing");
    r.attended_max = res.u("attended_max");
    r.budget_blocks = res.u("budget_blocks");
    r.rss_decode_kb = long(res.u("rss_kb"));
    sg_transfer_stats_t ds;
    sg_transfer_stats_init(&ds);
    ds.bytes = res.u("bytes");
    ds.bytes_full = res.u("bytes_full");
    ds.bytes_proactive = res.u("bytes_proactive");
    ds.bytes_on_demand = res.u("bytes_on_demand");
    ds.bytes_speculative = res.u("bytes_speculative");
    ds.digest_bytes = res.u("digest_bytes");
    ds.fetch_requests = res.u("fetch_requests");
    ds.fetch_blocks = res.u("fetch_blocks");
    ds.staged_bytes = res.u("staged_bytes");
    if (res.has("quantized_bytes")) {
        ds.quantized_bytes = res.u("quantized_bytes");
        ds.quantized_wire_bytes = res.u("quantized_wire_bytes");
    }
    fill_stats(r, ds);
    for (;;) {
        const Msg m = L.next("TOK/END");
        if (m.kind == "END") break;
        if (m.kind != "TOK") fatal("expected TOK or END from the decode side, got '" + m.kind + "'");
        std::istringstream in(m.body);
        int t;
        while (in >> t) r.tokens.push_back(t);
    }
    if (int(r.tokens.size()) != spec.n_new)
        fatal(fmt("the decode side reported %zu tokens, expected %d", r.tokens.size() - 1, spec.n_new - 1));

    sg_transfer_stats_t ps;
    sg_transfer_stats_init(&ps);
    check(sg_transfer_stats(L.xfer, &ps), "sg_transfer_stats");
    r.rma_ops = ps.rma_ops;
    if (spec.mode == Mode::kFull) check_wait(sg_transfer_wait(L.xfer, L.timeout_ns()), "sg_transfer_wait", o.timeout_s);
    check(sg_transfer_release(L.xfer), "sg_transfer_release");
    L.xfer = nullptr;
    L.notify("BYE");
    sg_session_close(L.session, 2000000000ull);  // best effort: the peer may have closed first
    r.rss_prefill_kb = max_rss_kb();
    return r;
}

// ---- decode side --------------------------------------------------------------------------------------

// The decode side, connected to host:port. Model: the real checkpoint (nullptr with --emulate on the
// prefill side is fine: the run's parameters come from the REQ message).
int run_decode(const Options& o, const Model* model, const std::string& host, uint16_t port) {
    g_role = "decode";
    const uint64_t c0 = now_ns();
    Link L;
    make_context(L, o, o.local_addr);
    sg_session_options_t so;
    sg_session_options_init(&so);
    sg_error_info_t err;
    sg_error_info_init(&err);
    check(sg_session_connect(L.ctx, host.c_str(), port, &so, L.timeout_ns(), &L.session, &err), "sg_session_connect",
          &err);

    std::string profile_json, wide_json;  // the decode-side profile; the prefetch predictor's (PRW)
    Msg req = L.next("REQ");
    while (req.kind == "PRF" || req.kind == "PRW") {
        (req.kind == "PRF" ? profile_json : wide_json) += req.body;
        req = L.next("REQ");
    }
    if (req.kind != "REQ") fatal("expected REQ from the prefill side, got '" + req.kind + "'");
    const RunSpec spec = decode_req(req);

    std::unique_ptr<Compute> comp;
    std::unique_ptr<Model> own_model;
    if (!spec.emu.name.empty()) {
        comp = std::make_unique<EmuCompute>(spec.emu);
    } else {
        if (!model) {  // a decode side started on its own loads the checkpoint only for a real model
            try {
                own_model = load_model(o);
            } catch (const ModelMissing& e) {
                g_last_fatal = e.what();
                throw;
            }
            model = own_model.get();
        }
        const Config& c = model->config();
        if (c.n_layers != spec.layers || c.n_kv_heads != spec.kv_heads || c.head_size() != spec.head_dim ||
            c.dim != spec.dim || c.vocab_size != spec.vocab)
            fatal(
                fmt("this side's model (%d layers, %d KV heads, head %d, dim %d, vocab %d) is not the prefill "
                    "side's (%d, %d, %d, %d, %d)",
                    c.n_layers, c.n_kv_heads, c.head_size(), c.dim, c.vocab_size, spec.layers, spec.kv_heads,
                    spec.head_dim, spec.dim, spec.vocab));
        if (int(spec.prompt_len) + spec.n_new - 1 > c.seq_len)
            fatal(fmt("prompt %llu + %d new tokens exceed the model's seq_len %d", (unsigned long long)spec.prompt_len,
                      spec.n_new, c.seq_len));
        comp = std::make_unique<ModelCompute>(*model, std::vector<int>{});
    }
    comp->make_pool(true, spec.prompt_len, spec.n_new, spec.block, KvDtype(spec.dtype));
    register_pool(L, comp->pool);
    const uint32_t nb = blocks_for(int(spec.prompt_len), spec.block);
    sg_transfer_options_t to;
    sg_transfer_options_init(&to);
    to.wire_quant = spec.wire_quant;  // consent: the prefill side asked for it in REQ
    {  // the prefill side's warm-up (see run_prefill), into the block the request's first one will use
        sg_transfer_t w = nullptr;
        sg_error_info_init(&err);
        sg_transfer_options_t wo;
        sg_transfer_options_init(&wo);
        check(sg_transfer_expect(L.session, "warm-up", L.kv, comp->table.data(), 1,
                                 std::min<uint64_t>(spec.prompt_len, uint64_t(spec.block)), &wo, &w, &err),
              "sg_transfer_expect (warm-up)", &err);
        const sg_status_t st = sg_transfer_wait(w, L.timeout_ns());
        sg_transfer_release(w);
        check_wait(st, "sg_transfer_wait (warm-up)", o.timeout_s);
    }
    to.paths = spec.paths;  // the post side decides; the same bits here
    sg_error_info_init(&err);
    check(sg_transfer_expect(L.session, "req-1", L.kv, comp->table.data(), nb, spec.prompt_len, &to, &L.xfer, &err),
          "sg_transfer_expect", &err);

    std::unique_ptr<ProactiveSets> psets;  // --attend budget: P of each layer, from the prefill side
    std::unique_ptr<SelectionAhead> ahead;  // emulated runs: before sparse, which points at it
    std::unique_ptr<SparseDecoder> sparse;
    sg_profile_t wide_profile = nullptr;  // prefetch: the predictor's profile and selector
    sg_selector_t wide_selector = nullptr;
    struct WideGuard {
        sg_profile_t& p;
        sg_selector_t& s;
        ~WideGuard() {
            if (s) sg_selector_destroy(s);
            if (p) sg_profile_destroy(p);
        }
    } wide_guard{wide_profile, wide_selector};
    if (spec.mode == Mode::kSelective) {
        if (!selective_available())
            fatal("the prefill side asked for the selective paths, which this side's libsmartgen lacks");
        sg_error_info_init(&err);
        check(sg_profile_parse(profile_json.data(), profile_json.size(), &L.profile, &err),
              "sg_profile_parse (the decode-side profile from the prefill side)", &err);
        const sg_kv_layout_t layout = layout_of(comp->pool);
        sg_error_info_init(&err);
        check(sg_selector_create(L.profile, &layout, spec.prompt_len, &L.selector, &err), "sg_selector_create", &err);
        if (spec.attend == Attend::kBudget) psets = std::make_unique<ProactiveSets>(uint32_t(comp->n_layers), nb);
        auto pump = [&L, &psets] {
            const Msg m = L.next("PSET", {}, 50);
            if (m.kind != "PSET")
                fatal("expected the proactive set (PSET) from the prefill side, got '" + m.kind + "'");
            psets->add(m.body);
        };
        SparsePolicies pol;
        pol.on_demand = spec.paths & SG_PATH_ON_DEMAND;
        pol.seamless = seamless_applies(spec);
        pol.parallel = spec.parallel;
        pol.prefetch = spec.prefetch && !wide_json.empty();
        pol.head_dim = comp->head_dim;
        pol.block_bytes = 2ull * uint64_t(spec.block) * uint64_t(comp->n_kv_heads) * uint64_t(comp->head_dim) *
                          dtype_bytes(KvDtype(spec.dtype));
        if (pol.prefetch) {
            sg_error_info_init(&err);
            check(sg_profile_parse(wide_json.data(), wide_json.size(), &wide_profile, &err),
                  "sg_profile_parse (the prefetch predictor's profile)", &err);
            sg_error_info_init(&err);
            check(sg_selector_create(wide_profile, &layout, spec.prompt_len, &wide_selector, &err),
                  "sg_selector_create (prefetch)", &err);
            pol.wide = wide_selector;
        }
        if (auto* emu = dynamic_cast<EmuCompute*>(comp.get())) {
            // One device model: the selection's kernels are charged to the modelled accelerator and
            // computed ahead on a thread of their own (select_ahead.hpp). Two steps ahead keep the
            // thread's work off the step's time while the transfer is sparse.
            const bool uniform = profile_json.find("\"layers\"") == std::string::npos;
            ahead = std::make_unique<SelectionAhead>(L.xfer, profile_json, layout, spec.prompt_len, *emu->keys(),
                                                     comp->n_layers, comp->n_heads, comp->head_dim, uniform, 2);
            pol.ahead = ahead.get();
            pol.modelled_select_ns = uint64_t(emu->select_s() * 1e9);
            pol.before_fetch = [emu] { emu->settle(); };
        }
        sparse = std::make_unique<SparseDecoder>(L.xfer, L.selector, comp->n_layers, comp->n_heads, nb, pol,
                                                 L.timeout_ns(), o.timeout_s, psets.get(), pump);
    }
    const uint64_t cold = now_ns() - c0;
    L.notify(Fields("READY").add("cold", cold).str());

    // The PSET messages of --attend budget come before FIRST (the prefill side sends each layer's as it
    // marks the layer written).
    const auto idle = [&] { return sparse && sparse->prepare_ready(); };
    Msg first = L.next("FIRST", idle);
    while (first.kind == "PSET" && psets) {
        psets->add(first.body);
        first = L.next("FIRST", idle);
    }
    if (first.kind != "FIRST") fatal("expected a FIRST message from the peer, got '" + first.kind + "'");
    if (first.u("prompt") != spec.prompt_len) fatal("the first token is for another prompt length");
    const uint64_t first_recv = now_ns();
    std::vector<int> toks{int(first.i("token"))};
    uint64_t t2 = 0, first_wait = 0, sparse_steps = 0, sel2 = 0, fetch2 = 0, calls2 = 0, whole2 = 0;
    // The steps after step 2, split by how they attended (sparse, or dense once the transfer was
    // complete), and when the 64th token was there (the end-to-end time of a 64-token response).
    uint64_t sparse_later_ns = 0, sparse_later_n = 0, dense_later_ns = 0, dense_later_n = 0, t64 = 0;
    bool dense = spec.mode == Mode::kFull;
    const int P = int(spec.prompt_len);
    for (int i = 1; i < spec.n_new; ++i) {
        AttendSet as;
        as.prompt_len = P;
        const AttendSet* ap = nullptr;
        if (spec.mode == Mode::kFull && i == 1) {
            // Step 2 starts at once and waits for each layer just before it needs it.
            as.select = [&](int l, const float*) -> const std::vector<uint32_t>* {
                const uint64_t t = now_ns();
                check_wait(sg_transfer_wait_layer(L.xfer, uint32_t(l), L.timeout_ns()), "sg_transfer_wait_layer",
                           o.timeout_s);
                first_wait += now_ns() - t;
                return nullptr;
            };
            ap = &as;
        }
        if (spec.mode == Mode::kSelective && !dense) {
            bool sparse_now;
            if (spec.sparse_steps >= 0) {
                sparse_now = i - 1 < spec.sparse_steps;
            } else {
                const sg_status_t st = sg_transfer_test(L.xfer);
                if (st != SG_OK && st != SG_IN_PROGRESS) check(st, "sg_transfer_test");
                sparse_now = st == SG_IN_PROGRESS;
            }
            if (sparse_now) {
                if (ahead) {
                    if (const std::string e = ahead->error(); !e.empty()) fatal("selection ahead: " + e);
                    ahead->at_step(uint64_t(i - 1));
                }
                if (sparse_steps > 0) sparse->prefetch_step();  // step 2 has no previous query
                as.select = [&](int l, const float* q) { return sparse->select(l, q); };
                if (spec.parallel) {
                    as.arriving = [&](int l) { return sparse->arriving(l); };
                    as.wait_arriving = [&](int l) { sparse->wait_arriving(l); };
                }
                ap = &as;
                ++sparse_steps;
            } else {
                if (ahead) ahead->stop();
                sparse->complete(spec.paths & SG_PATH_SPECULATIVE);
                dense = true;
            }
        }
        const uint64_t step_start = now_ns();
        const bool step_sparse = ap && spec.mode == Mode::kSelective;
        toks.push_back(comp->step(P + i - 1, toks.back(), ap));
        if (i >= 2) {
            (step_sparse ? sparse_later_ns : dense_later_ns) += now_ns() - step_start;
            (step_sparse ? sparse_later_n : dense_later_n) += 1;
        }
        if (toks.size() == 64) t64 = now_ns();
        if (i == 1) {
            t2 = now_ns();
            if (sparse) {
                first_wait =
                    sparse->essential_wait_ns + sparse->pset_wait_ns + sparse->fetch_wait_ns + sparse->complete_wait_ns;
                sel2 = sparse->selector_ns;
                fetch2 = sparse->fetch_wait_ns;
                calls2 = sparse->fetch_calls;
                whole2 = sparse->whole_layers;
            }
        }
        if (!spec.emu.name.empty() && spec.n_new >= 16 && i % (spec.n_new / 4) == 0)
            progress(fmt("decode: %d/%d tokens", i + 1, spec.n_new));
    }
    const uint64_t tlast = now_ns();
    if (sparse) sparse->count_untaken_proactive();
    // A full transfer is always received whole (also when no decode step needed it).
    if (spec.mode == Mode::kFull) check_wait(sg_transfer_wait(L.xfer, L.timeout_ns()), "sg_transfer_wait", o.timeout_s);

    sg_transfer_stats_t st;
    sg_transfer_stats_init(&st);
    check(sg_transfer_stats(L.xfer, &st), "sg_transfer_stats");
    Fields res("RES");
    res.add("t2", t2).add("tlast", tlast).add("first_wait", first_wait).add("sparse_steps", sparse_steps);
    res.add("t64", t64).add("sp_ns", sparse_later_ns).add("sp_n", sparse_later_n).add("dn_ns", dense_later_ns);
    res.add("dn_n", dense_later_n);
    res.add("first_recv", first_recv).add("sel2", sel2).add("fetch2", fetch2).add("calls2", calls2);
    res.add("dig_floats", sparse ? uint64_t(sparse->digest_floats()) : 0).add("whole2", whole2);
    if (sparse) {
        res.add("whole", sparse->whole_layers).add("s_waited", sparse->seamless_waited);
        res.add("s_wait", sparse->seamless_wait_ns).add("pf_calls", sparse->prefetch_calls);
        res.add("pf_blocks", sparse->prefetch_blocks).add("pf_hits", sparse->prefetch_hits);
        res.add("pf_misses", sparse->prefetch_misses).add("pf_wasted", sparse->prefetch_wasted);
        res.add("pf_ns", sparse->prefetch_ns);
    }
    uint64_t sel = 0, fetch_wait = 0, ess = 0, pset_wait = 0, comp_wait = 0, attended = 0, layer_steps = 0, calls = 0,
             fetched = 0, dropped = 0, selected = 0, in_p = 0, p_blocks = 0, p_layers = 0, p_missing = 0, att_max = 0,
             budget = 0;
    if (sparse) {
        sel = sparse->selector_ns;
        fetch_wait = sparse->fetch_wait_ns;
        ess = sparse->essential_wait_ns;
        pset_wait = sparse->pset_wait_ns;
        comp_wait = sparse->complete_wait_ns;
        attended = sparse->attended_blocks;
        layer_steps = sparse->layer_steps;
        calls = sparse->fetch_calls;
        fetched = sparse->fetched_blocks;
        dropped = sparse->dropped_blocks;
        selected = sparse->selected;
        in_p = sparse->selected_in_p;
        p_blocks = sparse->proactive_blocks;
        p_layers = sparse->proactive_layers;
        p_missing = sparse->proactive_missing;
        att_max = sparse->attended_max;
        budget = sparse->budget_blocks;
    }
    res.add("sel", sel).add("fetch_wait", fetch_wait).add("ess_wait", ess).add("pset_wait", pset_wait);
    if (ahead) {
        ahead->stop();
        res.add("ah_cpu", ahead->cpu_ns()).add("ah_taken", sparse->ahead_taken).add("ah_late", sparse->ahead_late);
    }
    res.add("complete_wait", comp_wait);
    res.add("attended", attended).add("layer_steps", layer_steps).add("fetch_calls", calls).add("fetched", fetched);
    res.add("dropped", dropped).add("selected", selected).add("selected_in_p", in_p);
    res.add("p_blocks", p_blocks).add("p_layers", p_layers).add("p_missing", p_missing).add("attended_max", att_max);
    res.add("budget_blocks", budget);
    res.add("bytes", st.bytes).add("bytes_full", st.bytes_full).add("bytes_proactive", st.bytes_proactive);
    res.add("bytes_on_demand", st.bytes_on_demand).add("bytes_speculative", st.bytes_speculative);
    res.add("digest_bytes", st.digest_bytes).add("fetch_requests", st.fetch_requests);
    res.add("fetch_blocks", st.fetch_blocks).add("staged_bytes", st.staged_bytes);
    res.add("quantized_bytes", st.quantized_bytes).add("quantized_wire_bytes", st.quantized_wire_bytes);
    res.add("rss_kb", uint64_t(max_rss_kb()));
    L.notify(res.str());
    std::string chunk = "TOK";
    for (size_t i = 1; i < toks.size(); ++i) {
        chunk += ' ' + std::to_string(toks[i]);
        if (chunk.size() > 3800) {
            L.notify(chunk);
            chunk = "TOK";
        }
    }
    if (chunk.size() > 3) L.notify(chunk);
    L.notify("END");

    // Release (cancels what the speculative path has not sent yet), then the prefill side says BYE.
    check(sg_transfer_release(L.xfer), "sg_transfer_release");
    L.xfer = nullptr;
    // PSET messages no sparse step asked for may still be queued ahead of BYE.
    Msg bye = L.next("BYE");
    while (bye.kind == "PSET" && psets) bye = L.next("BYE");
    if (bye.kind != "BYE") fatal("expected a BYE message from the peer, got '" + bye.kind + "'");
    sg_session_close(L.session, 2000000000ull);
    if (o.role == Role::kDecode) progress(fmt("done: %zu tokens generated here", toks.size() - 1));
    return 0;
}

// ---- main ---------------------------------------------------------------------------------------------

uint16_t read_port(int fd, int timeout_s) {
    unsigned char b[2];
    size_t got = 0;
    while (got < 2) {
        pollfd p{fd, POLLIN, 0};
        const int r = poll(&p, 1, timeout_s * 1000);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fatal("no port from the prefill process");
        const ssize_t n = read(fd, b + got, 2 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fatal("the prefill process closed the pipe without a port");
        got += size_t(n);
    }
    return uint16_t((b[0] << 8) | b[1]);
}

int main_impl(int argc, char** argv) {
    std::optional<Options> parsed;
    try {
        parsed = parse_args(argc, argv);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "smartgen-disagg: %s\n", e.what());
        return 2;
    }
    if (!parsed) return 0;
    const Options o = *parsed;
    g_quiet = o.quiet;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // modelled compute sleeps to the microsecond

    try {
        // The model: not with --emulate, and not yet on a decode side started on its own, which learns
        // from the prefill side's REQ whether it needs one (an emulated run opens no checkpoint).
        std::unique_ptr<Model> model;
        std::string label;
        std::vector<int> prompt;
        if (o.emulate.empty() && o.role != Role::kDecode) {
            std::string path;
            model = load_model(o, &path);
            const Config& c = model->config();
            label = fmt("%s (dim %d, %d layers, %d heads, %d KV heads, vocab %d)",
                        std::filesystem::path(path).filename().c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads,
                        c.vocab_size);
            if (o.make_prompt > 0) {
                const std::vector<int> p = sample_prompt(*model, o.make_prompt, o.seed);
                std::string s = "[";
                for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + std::to_string(p[i]);
                std::printf("%s]\n", s.c_str());
                return 0;
            }
            if (o.role != Role::kDecode) {
                prompt = o.prompt_file.empty() ? std::vector<int>(std::begin(kDefaultPrompt), std::end(kDefaultPrompt))
                                               : read_token_file(o.prompt_file, "--prompt-tokens");
                for (size_t i = 0; i < prompt.size(); ++i)
                    if (prompt[i] >= c.vocab_size)
                        throw UsageError(
                            fmt("--prompt-tokens: token %d at position %zu is outside the vocabulary of %d", prompt[i],
                                i, c.vocab_size));
                if (int(prompt.size()) + o.max_new_tokens - 1 > c.seq_len)
                    throw UsageError(
                        fmt("--max-new-tokens: %zu prompt tokens + %d new ones exceed the model's "
                            "seq_len %d",
                            prompt.size(), o.max_new_tokens, c.seq_len));
            }
        } else if (o.make_prompt > 0) {
            throw UsageError("--make-prompt: not with --emulate");
        }

        if (o.mode == Mode::kColocated && o.role == Role::kBoth) {
            print_results(run_colocated(o, *model, prompt, label), o.json);
            return 0;
        }
        if (o.mode == Mode::kSelective && !selective_available())
            fatal(
                "--mode selective: the loaded libsmartgen lacks the selective paths (sg_profile_*, sg_selector_*, "
                "sg_transfer_fetch, ...)");
        if (o.role != Role::kBoth && !key_file_set())
            throw UsageError("--role: both sides must hold the same key: set SG_AUTH_KEY_FILE");

        // The run's parameters (the decode side takes them from the REQ message).
        RunSpec spec;
        std::unique_ptr<Compute> comp;
        if (o.role != Role::kDecode) {
            spec.mode = o.mode;
            spec.paths = o.mode == Mode::kFull ? SG_PATH_FULL
                                               : SG_PATH_PROACTIVE | (o.on_demand ? SG_PATH_ON_DEMAND : 0u) |
                                                     (o.speculative ? SG_PATH_SPECULATIVE : 0u);
            spec.n_new = o.max_new_tokens;
            spec.block = o.block_tokens;
            spec.dtype = o.kv_dtype;
            spec.sparse_steps = o.sparse_steps;
            spec.window = o.window;
            spec.full_stream = o.full_stream;
            spec.attend = o.attend;
            spec.seamless = o.seamless;
            spec.parallel = o.parallel;
            spec.prefetch = o.prefetch;
            spec.wire_quant = o.wire_quant;
            if (o.emulate.empty()) {
                const Config& c = model->config();
                spec.prompt_len = prompt.size();
                spec.layers = c.n_layers;
                spec.kv_heads = c.n_kv_heads;
                spec.head_dim = c.head_size();
                spec.dim = c.dim;
                spec.vocab = c.vocab_size;
                comp = std::make_unique<ModelCompute>(*model, prompt);
            } else {
                spec.emu.name = o.emulate;
                spec.emu.tokens = o.emulate_tokens;
                spec.emu.tflops = o.prefill_tflops;
                spec.emu.tbps = o.decode_tbps;
                spec.emu.mass = o.mass;
                spec.emu.overlap = o.overlap;
                spec.emu.seed = o.seed;
                spec.prompt_len = o.emulate_tokens;
                const EmuShape& sh = *find_emu_shape(o.emulate);
                spec.layers = sh.layers;
                spec.kv_heads = sh.n_kv_heads;
                spec.head_dim = sh.head_dim;
                spec.dim = sh.dim;
                spec.vocab = sh.vocab;
                // Memory bound: each side keeps up to 8 K regions (key patterns) within 2 GiB and one V
                // region; the decode side also holds the digests (the runtime's copy, this program's
                // cache up to 1 GiB, and the selection-ahead thread's copy of one layer per pattern).
                const uint64_t region = uint64_t(blocks_for(int(spec.prompt_len), spec.block)) * spec.block *
                                        uint64_t(sh.n_kv_heads) * uint64_t(sh.head_dim) * 2;
                const double digests = o.mode == Mode::kSelective
                                           ? double(blocks_for(int(spec.prompt_len), spec.block)) * sh.n_kv_heads * 2 *
                                                 sh.head_dim * 4 * sh.layers
                                           : 0.0;
                const double patterns = double(std::clamp<uint64_t>((2ull << 30) / region, 1, 8));
                const double decode_bytes = double(region) * (1 + patterns) + digests +
                                            std::min(digests, double(1ull << 30)) + digests * patterns / sh.layers;
                const double prefill_bytes = double(region) * (1 + patterns);
                if (decode_bytes > 3.5 * double(1ull << 30) || prefill_bytes > 3.5 * double(1ull << 30))
                    throw UsageError(
                        fmt("--emulate-tokens: %llu tokens need about %.1f GiB on the decode side and "
                            "%.1f GiB on the prefill side; each process must stay under 4 GiB",
                            (unsigned long long)o.emulate_tokens, decode_bytes / (1ull << 30),
                            prefill_bytes / (1ull << 30)));
                comp = std::make_unique<EmuCompute>(spec.emu);
                label = fmt("%s (emulated: %d layers, %d KV heads, head_dim %d, fp16)", sh.name, sh.layers,
                            sh.n_kv_heads, sh.head_dim);
            }
        }

        if (o.role == Role::kPrefill) {
            const Results r = run_prefill(o, *comp, spec, label, -1);
            print_results(r, o.json);
            return 0;
        }
        if (o.role == Role::kDecode) {
            std::string host;
            uint16_t port = 0;
            split_host_port(o.peer, "--peer", host, port);
            return run_decode(o, model.get(), host, port);
        }

        // Both sides: fork before any SmartGen call; the key is made first so both hold it.
        if (!key_file_set()) make_key();
        int fds[2];
        if (pipe(fds) != 0) fatal(std::string("pipe: ") + std::strerror(errno));
        std::fflush(nullptr);
        const pid_t pid = fork();
        if (pid < 0) fatal(std::string("fork: ") + std::strerror(errno));
        if (pid == 0) {
            close(fds[1]);
            g_role = "decode";
            int rc = 1;
            try {
                const uint16_t port = read_port(fds[0], o.timeout_s);
                close(fds[0]);
                rc = run_decode(o, model.get(), "127.0.0.1", port);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "smartgen-disagg [decode]: %s\n", e.what());
            }
            std::fflush(nullptr);
            _exit(rc);
        }
        g_child = pid;
        close(fds[0]);
        Results r;
        try {
            r = run_prefill(o, *comp, spec, label, fds[1]);
        } catch (...) {
            if (g_child_status < 0) {
                kill(g_child, SIGTERM);
                waitpid(g_child, nullptr, 0);
            }
            throw;
        }
        int ws = g_child_status;
        if (ws < 0)
            while (waitpid(g_child, &ws, 0) < 0 && errno == EINTR) {
            }
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            fatal(fmt("the decode process failed (%s %d)", WIFEXITED(ws) ? "status" : "signal",
                      WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws)));
        print_results(r, o.json);
        return 0;
    } catch (const UsageError& e) {
        std::fprintf(stderr, "smartgen-disagg: %s\n", e.what());
        return 2;
    } catch (const ModelMissing& e) {
        const int status = model_files::missing_exit_status();
        std::fprintf(stderr, "smartgen-disagg [%s]: %s%s\n", g_role, e.what(),
                     status == 77 ? "" : " (SMARTGEN_REQUIRE_DATA=1: a failure)");
        return status;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "smartgen-disagg [%s]: %s\n", g_role, e.what());
        return 1;
    }
}

}  // namespace
}  // namespace sg::disagg

int main(int argc, char** argv) { return sg::disagg::main_impl(argc, argv); }
