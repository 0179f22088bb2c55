// smartgen-soak: a bounded soak of the public API (docs/soak.md). An orchestrator process starts
// prefill and decode worker processes (each holding several contexts, one session per context pair),
// kills one of them with SIGKILL now and then and restarts it, and checks what every worker reports:
// every byte verified at the decode side, every failure explained, resources back to the baseline.
//
// Files: soak.hpp (shared declarations), spec.cpp (configuration, transfer specs, pools, the byte
// pattern, resource sampling), session.cpp (one side of one session: transfers, cancels, fetches,
// loss), worker.cpp (a worker process), main.cpp (the orchestrator). Public header only.
#pragma once

#include <smartgen/smartgen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace soak {

constexpr uint64_t kSecond = 1000000000ull;

struct Config {
    uint64_t seed = 1;
    int prefill_procs = 4;
    int decode_procs = 4;
    int sessions = 64;        // one context pair each
    int transfers = 1000;     // per session, counted across reconnects
    int window = 2;           // transfers in flight per session (disjoint block slots)
    int kills = 16;           // SIGKILLs over the run (each hits the sessions of one process)
    int warmup = 6;           // transfers per context against an in-process partner before the baseline
    double cancel_rate = 0.08;  // share of transfers with a cancel (either side, before/after the match)
    std::string cancel_modes = "prefill-before,prefill-after,decode-before,decode-after";
    double rss_bound_mib = 96;  // end RSS may exceed the baseline by this much (allocators keep pages)
    int timeout_s = 1800;       // whole run; a worker's single wait is bounded by wait_s
    int wait_s = 60;
    int progress_s = 5;
    std::string providers = "tcp,shm";  // sessions alternate over these
    bool verify = false;                // SG_TRANSFER_VERIFY=1 in every worker (end-to-end CRCs)
    int hog_threads = 0;                // busy threads beside each worker: a host whose CPUs are shared
    // worker only
    std::string role;  // "prefill" or "decode"
    int index = -1;
    int incarnation = 0;
};

// Parses argv; returns false (with a message on stderr) on a bad argument. --help prints usage.
bool parse_args(int argc, char **argv, Config &cfg, bool &help);
void usage();
std::vector<std::string> worker_args(const Config &cfg, const std::string &role, int index, int incarnation);

// ---- mapping of sessions to processes -------------------------------------------------------
// Session s: prefill process s % NP (local index s / NP); decode process (s / NP) % ND (local index
// a + NP * q where s = a + NP * (b + ND * q)). Every prefill process talks to every decode process.
int prefill_proc_of(const Config &c, int s);
int decode_proc_of(const Config &c, int s);
std::vector<int> sessions_of(const Config &c, bool prefill, int index);  // in local-index order
const char *provider_of(const Config &c, int s);  // "tcp" or "shm"

// ---- transfer specs (a pure function of seed, session key and transfer number) ----------------
enum class Cancel { None, PrefillBefore, PrefillAfter, DecodeBefore, DecodeAfter };
const char *cancel_name(Cancel c);

struct Spec {
    int kind;
    uint64_t tokens;
    uint32_t paths;
    bool all_written;      // prefill posts with SG_TRANSFER_ALL_LAYERS_WRITTEN
    Cancel cancel;
    bool fetch_all;        // decode fetches every block (on-demand without speculative)
    int fetch_rounds;      // decode's random fetches (on-demand)
    int priority;
    bool shuffle_layers;
    uint64_t req_hash;     // seeds the byte pattern
};
Spec make_spec(const Config &c, uint64_t skey, uint64_t n);
std::string request_id(uint64_t skey, uint64_t n);

// A per-(transfer, side) stream of random numbers.
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next();
    uint64_t below(uint64_t n) { return n ? next() % n : 0; }
    double unit() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
};
uint64_t mix(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0);

// ---- pools ---------------------------------------------------------------------------------------
constexpr int kKinds = 4;
// One registered pool of one layout kind; the decode side's variant differs in packing, block
// order, stride and block count (the runtime maps them), never in shape, dtype or tokens per block.
struct Pool {
    sg_kv_layout_t layout{};
    sg_kv_handle_t handle = nullptr;
    std::vector<void *> kbase, vbase;
    std::vector<unsigned char> mem;  // all layers
    uint64_t plane = 0, stride = 0;
    size_t vec = 0;  // bytes of one (token, head) vector: head_dim * dtype size
    unsigned char *vector(uint32_t layer, uint32_t block, int kv, uint32_t j, uint32_t head) const;
};
// Builds and registers the pools of every kind for a role. false on failure (message on stderr).
bool make_pools(sg_context_t ctx, bool prefill, std::vector<Pool> &out);
void destroy_pools(std::vector<Pool> &pools);
// Max tokens a transfer of this kind may carry (a window slot on both sides).
uint64_t max_tokens(const Config &c, int kind);
// The side's block table for transfer n: ceil(tokens / tpb) distinct blocks of slot n % window.
std::vector<uint32_t> block_table(const Config &c, const Pool &p, const Spec &sp, uint64_t skey, uint64_t n,
                                  bool prefill);

// ---- the byte pattern ------------------------------------------------------------------------------
// A (layer, K/V, token, head) vector's bytes are a function of the request's hash and those
// coordinates (token = logical block * tokens_per_block + offset), so no reference copy is needed and
// any byte from another request, layer, block or position is caught.
constexpr unsigned char kPoison = 0xA5;  // decode blocks before expect; slots past num_tokens keep it
void fill_layer(const Pool &p, const Spec &sp, const std::vector<uint32_t> &table, uint32_t layer);
void poison(const Pool &p, const std::vector<uint32_t> &table);
// Verifies the given logical blocks of a layer (all when blocks is empty); returns bytes verified, or
// sets *bad to a description of the first wrong byte.
uint64_t verify_blocks(const Pool &p, const Spec &sp, const std::vector<uint32_t> &table, uint32_t layer,
                       const std::vector<uint32_t> &blocks, std::string *bad);

// ---- resources -------------------------------------------------------------------------------------
struct Resources {
    uint64_t rss = 0;   // bytes (/proc/self/statm)
    uint64_t fds = 0;   // entries of /proc/self/fd
    uint64_t registrations = 0;  // sum of sg_context_stats().registrations over the process's contexts
    // Descriptors the end may hold beyond the baseline (finding 2 in docs/soak.md): a tcp context
    // keeps one connection per lane to a live peer context after a close both sides finished.
    uint64_t kept_fds_allowed = 0;
};
Resources sample(const std::vector<sg_context_t> &ctxs);
// Open descriptors and what they point at (readlink of /proc/self/fd/N), to name what leaked.
std::vector<std::pair<int, std::string>> fd_table();

// ---- helpers -----------------------------------------------------------------------------------------
uint64_t now_ns();
void sleep_ms(int ms);
sg_context_t make_context(const char *provider, const std::string &tag);

int run_worker(const Config &cfg);       // worker.cpp
int run_orchestrator(const Config &cfg, const char *self);  // main.cpp

}  // namespace soak
