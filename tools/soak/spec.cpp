// Configuration, session mapping, transfer specs, pools, the byte pattern and resource sampling.
#include "soak.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace soak {

// ---- arguments ---------------------------------------------------------------------------------
void usage() {
    std::puts(
        "smartgen-soak [--short] [options]    bounded soak of the public API (docs/soak.md)\n"
        "  --short                 CI form: 8 sessions, 2+2 processes, 200 transfers each, 2 kills\n"
        "  --seed N                random seed (default 1); a run is replayable from it\n"
        "  --sessions N            sessions = context pairs (default 64)\n"
        "  --prefill-procs N       prefill processes (default 4)\n"
        "  --decode-procs N        decode processes (default 4); sessions % (NP*ND) must be 0\n"
        "  --transfers N           transfers per session (default 1000)\n"
        "  --window N              transfers in flight per session (default 2)\n"
        "  --kills N               SIGKILL + restart of a random worker, N times (default 16)\n"
        "  --warmup N              warm-up transfers per context before the baseline (default 6)\n"
        "  --cancel-rate X         share of transfers with a cancel (default 0.08)\n"
        "  --cancel-modes LIST     of prefill-before,prefill-after,decode-before,decode-after (default all;\n"
        "                          before/after = before the peer's post/expect, after the first layer)\n"
        "  --rss-bound-mib X       allowed RSS growth per process, end vs baseline (default 96)\n"
        "  --providers LIST        sessions alternate over these: tcp,shm (default), tcp, shm\n"
        "  --hog-threads N         N threads spinning at normal priority in every worker process, as an\n"
        "                          engine's would beside the runtime (default 0); no session may be lost\n"
        "  --verify                end-to-end verification in every context (SG_TRANSFER_VERIFY=1): the\n"
        "                          runtime checks each block's CRC on arrival; one mismatch fails the run\n"
        "  --timeout S             whole run (default 1800); --wait S: one wait in a worker (60)\n"
        "  --progress S            seconds between progress lines (default 5)\n"
        "Exit status 0 when no unexpected failure happened, every byte checked was right, and every\n"
        "process's registrations and descriptors are back to the baseline (RSS within the bound).");
}

static bool num(const char *s, double &out) {
    char *end = nullptr;
    out = std::strtod(s, &end);
    return end && *end == 0 && end != s;
}

bool parse_args(int argc, char **argv, Config &c, bool &help) {
    help = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--short") {
            c.sessions = 8, c.prefill_procs = 2, c.decode_procs = 2, c.transfers = 200, c.kills = 2;
            c.warmup = 4, c.timeout_s = 120, c.wait_s = 15, c.progress_s = 2, c.cancel_rate = 0.15;
            continue;
        }
        if (a == "--verify") {
            c.verify = true;
            continue;
        }
        if (a == "--help" || a == "-h") {
            help = true;
            return true;
        }
        if (i + 1 >= argc) {
            std::fprintf(stderr, "smartgen-soak: %s needs a value (or is unknown)\n", a.c_str());
            return false;
        }
        const char *v = argv[++i];
        double d = 0;
        bool numeric = num(v, d);
        auto need = [&](bool ok) {
            if (!ok) std::fprintf(stderr, "smartgen-soak: bad value for %s: %s\n", a.c_str(), v);
            return ok;
        };
        if (a == "--seed") {
            if (!need(numeric)) return false;
            c.seed = std::strtoull(v, nullptr, 10);
        } else if (a == "--sessions") {
            if (!need(numeric && d >= 1)) return false;
            c.sessions = int(d);
        } else if (a == "--prefill-procs") {
            if (!need(numeric && d >= 1)) return false;
            c.prefill_procs = int(d);
        } else if (a == "--decode-procs") {
            if (!need(numeric && d >= 1)) return false;
            c.decode_procs = int(d);
        } else if (a == "--transfers") {
            if (!need(numeric && d >= 1)) return false;
            c.transfers = int(d);
        } else if (a == "--window") {
            if (!need(numeric && d >= 1 && d <= 4)) return false;
            c.window = int(d);
        } else if (a == "--kills") {
            if (!need(numeric && d >= 0)) return false;
            c.kills = int(d);
        } else if (a == "--warmup") {
            if (!need(numeric && d >= 0)) return false;
            c.warmup = int(d);
        } else if (a == "--cancel-rate") {
            if (!need(numeric && d >= 0 && d <= 1)) return false;
            c.cancel_rate = d;
        } else if (a == "--cancel-modes") {
            std::string m = std::string(",") + v + ",";
            for (const char *k : {",prefill-before,", ",prefill-after,", ",decode-before,", ",decode-after,"}) {
                size_t at = m.find(k);
                if (at != std::string::npos) m.erase(at, std::strlen(k) - 1);
            }
            if (!need(m == "," || m == ",,")) return false;
            c.cancel_modes = v;
        } else if (a == "--rss-bound-mib") {
            if (!need(numeric && d >= 0)) return false;
            c.rss_bound_mib = d;
        } else if (a == "--providers") {
            std::string p = v;
            if (!need(p == "tcp,shm" || p == "tcp" || p == "shm" || p == "shm,tcp")) return false;
            c.providers = p;
        } else if (a == "--hog-threads") {
            if (!need(numeric && d >= 0 && d <= 64)) return false;
            c.hog_threads = int(d);
        } else if (a == "--timeout") {
            if (!need(numeric && d >= 1)) return false;
            c.timeout_s = int(d);
        } else if (a == "--wait") {
            if (!need(numeric && d >= 1)) return false;
            c.wait_s = int(d);
        } else if (a == "--progress") {
            if (!need(numeric && d >= 1)) return false;
            c.progress_s = int(d);
        } else if (a == "--worker") {
            c.role = v;
        } else if (a == "--index") {
            c.index = int(d);
        } else if (a == "--incarnation") {
            c.incarnation = int(d);
        } else {
            std::fprintf(stderr, "smartgen-soak: unknown option %s (--help)\n", a.c_str());
            return false;
        }
    }
    if (c.sessions % (c.prefill_procs * c.decode_procs) != 0) {
        std::fprintf(stderr, "smartgen-soak: --sessions (%d) must be a multiple of prefill-procs x decode-procs (%d)\n",
                     c.sessions, c.prefill_procs * c.decode_procs);
        return false;
    }
    return true;
}

std::vector<std::string> worker_args(const Config &c, const std::string &role, int index, int incarnation) {
    char rate[32], bound[32];
    std::snprintf(rate, sizeof rate, "%.6f", c.cancel_rate);
    std::snprintf(bound, sizeof bound, "%.3f", c.rss_bound_mib);
    return {"--seed", std::to_string(c.seed), "--sessions", std::to_string(c.sessions), "--prefill-procs",
            std::to_string(c.prefill_procs), "--decode-procs", std::to_string(c.decode_procs), "--transfers",
            std::to_string(c.transfers), "--window", std::to_string(c.window), "--kills", std::to_string(c.kills),
            "--warmup", std::to_string(c.warmup), "--cancel-rate", rate, "--cancel-modes", c.cancel_modes, "--rss-bound-mib", bound, "--providers",
            c.providers, "--hog-threads", std::to_string(c.hog_threads), "--wait", std::to_string(c.wait_s), "--timeout", std::to_string(c.timeout_s), "--worker",
            role, "--index", std::to_string(index), "--incarnation", std::to_string(incarnation)};
}

// ---- mapping -------------------------------------------------------------------------------------
int prefill_proc_of(const Config &c, int s) { return s % c.prefill_procs; }
int decode_proc_of(const Config &c, int s) { return (s / c.prefill_procs) % c.decode_procs; }

std::vector<int> sessions_of(const Config &c, bool prefill, int index) {
    std::vector<std::pair<int, int>> v;  // (local index, session)
    for (int s = 0; s < c.sessions; ++s) {
        if (prefill && prefill_proc_of(c, s) == index) v.push_back({s / c.prefill_procs, s});
        if (!prefill && decode_proc_of(c, s) == index) {
            int a = s % c.prefill_procs, q = s / (c.prefill_procs * c.decode_procs);
            v.push_back({a + c.prefill_procs * q, s});
        }
    }
    std::sort(v.begin(), v.end());
    std::vector<int> out;
    for (auto &e : v) out.push_back(e.second);
    return out;
}

const char *provider_of(const Config &c, int s) {
    if (c.providers == "tcp") return "tcp";
    if (c.providers == "shm") return "shm";
    // Alternate so that every process holds both kinds: parity of (prefill proc + local index).
    return ((s % c.prefill_procs + s / c.prefill_procs) % 2 == 0) ? "tcp" : "shm";
}

// ---- random numbers and specs ----------------------------------------------------------------------
static uint64_t splitmix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
uint64_t Rng::next() { return s = splitmix(s); }
uint64_t mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return splitmix(splitmix(splitmix(splitmix(a) ^ b) ^ c) ^ d);
}

const char *cancel_name(Cancel c) {
    switch (c) {
    case Cancel::None: return "none";
    case Cancel::PrefillBefore: return "prefill-before-match";
    case Cancel::PrefillAfter: return "prefill-after-match";
    case Cancel::DecodeBefore: return "decode-before-match";
    case Cancel::DecodeAfter: return "decode-after-match";
    }
    return "?";
}

std::string request_id(uint64_t skey, uint64_t n) {
    char b[64];
    std::snprintf(b, sizeof b, "soak-%llx-%llu", (unsigned long long)skey, (unsigned long long)n);
    return b;
}

static sg_dtype_t kind_dtype(int kind);

Spec make_spec(const Config &c, uint64_t skey, uint64_t n) {
    Rng r(mix(c.seed, skey, n, 0));
    Spec sp{};
    sp.kind = int(r.below(kKinds));
    uint64_t mt = max_tokens(c, sp.kind);
    // Half the transfers small (up to a quarter of the slot), half anywhere up to the slot.
    sp.tokens = 1 + r.below(r.unit() < 0.5 ? std::max<uint64_t>(1, mt / 4) : mt);
    sp.cancel = Cancel::None;
    if (r.unit() < c.cancel_rate) {
        std::vector<Cancel> modes;
        for (int m = 1; m <= 4; ++m) {
            std::string name = cancel_name(Cancel(m));
            name = name.substr(0, name.size() - 6);  // "-match"
            if (("," + c.cancel_modes + ",").find("," + name + ",") != std::string::npos) modes.push_back(Cancel(m));
        }
        if (!modes.empty()) sp.cancel = modes[r.below(modes.size())];
    }
    if (sp.cancel == Cancel::PrefillAfter || sp.cancel == Cancel::DecodeAfter || r.unit() < 0.5)
        sp.paths = SG_PATH_FULL;
    else
        sp.paths = uint32_t(1 + r.below(7)) << 1;  // a non-empty combination of the selective paths
    // Selection reads fp32/fp16/bf16 keys only (the post answers SG_ERR_UNSUPPORTED for fp8 with the
    // proactive path), so fp8 pools run the other selective paths.
    if (kind_dtype(sp.kind) == SG_DTYPE_FP8_E4M3 && (sp.paths & SG_PATH_PROACTIVE)) {
        sp.paths &= ~SG_PATH_PROACTIVE;
        if (!sp.paths) sp.paths = SG_PATH_SPECULATIVE;
    }
    sp.all_written = r.unit() < 0.3;
    sp.fetch_all = r.unit() < 0.3;
    sp.fetch_rounds = int(1 + r.below(3));
    sp.priority = int(r.below(3)) - 1;
    sp.shuffle_layers = r.unit() < 0.25;
    sp.req_hash = mix(c.seed, skey, n, 99);
    return sp;
}

// ---- pools -----------------------------------------------------------------------------------------
struct Kind {
    uint32_t layers, heads, dim, tpb;
    sg_dtype_t dtype;
    uint64_t blocks;
    // prefill variant, decode variant
    sg_kv_packing_t pack[2];
    sg_block_order_t order[2];
    uint64_t pad[2];       // stride = natural block bytes + pad
    uint64_t extra[2];     // blocks added to `blocks`
};
// A few layouts of different shapes and element sizes; the decode variant differs in what the runtime
// maps (packing, order, stride, block ids). Pools are 0.5-7.5 MiB, so 128 contexts stay near 1.2 GiB.
static const Kind kKindTable[kKinds] = {
    {4, 2, 64, 16, SG_DTYPE_FP16, 48, {SG_KV_SEPARATE, SG_KV_SEPARATE}, {SG_BLOCK_TOKEN_MAJOR, SG_BLOCK_HEAD_MAJOR},
     {0, 0}, {0, 5}},
    {8, 4, 128, 16, SG_DTYPE_BF16, 24, {SG_KV_SEPARATE, SG_KV_FUSED}, {SG_BLOCK_TOKEN_MAJOR, SG_BLOCK_TOKEN_MAJOR},
     {0, 512}, {0, 5}},
    {2, 1, 32, 8, SG_DTYPE_FP32, 128, {SG_KV_FUSED, SG_KV_SEPARATE}, {SG_BLOCK_HEAD_MAJOR, SG_BLOCK_TOKEN_MAJOR},
     {0, 0}, {0, 5}},
    {3, 8, 64, 32, SG_DTYPE_FP8_E4M3, 16, {SG_KV_SEPARATE, SG_KV_SEPARATE}, {SG_BLOCK_HEAD_MAJOR, SG_BLOCK_HEAD_MAJOR},
     {0, 256}, {0, 5}},
};

static sg_dtype_t kind_dtype(int kind) { return kKindTable[kind].dtype; }

uint64_t max_tokens(const Config &c, int kind) {
    const Kind &k = kKindTable[kind];
    uint64_t slot = std::min(k.blocks + k.extra[0], k.blocks + k.extra[1]) / uint64_t(c.window);
    return slot * k.tpb;
}

unsigned char *Pool::vector(uint32_t layer, uint32_t block, int kv, uint32_t j, uint32_t head) const {
    unsigned char *base;
    if (layout.packing == SG_KV_FUSED)
        base = static_cast<unsigned char *>(kbase[layer]) + block * stride + (kv ? plane : 0);
    else
        base = static_cast<unsigned char *>(kv ? vbase[layer] : kbase[layer]) + block * stride;
    size_t idx = layout.block_order == SG_BLOCK_TOKEN_MAJOR ? size_t(j) * layout.num_kv_heads + head
                                                            : size_t(head) * layout.tokens_per_block + j;
    return base + idx * vec;
}

bool make_pools(sg_context_t ctx, bool prefill, std::vector<Pool> &out) {
    out.clear();
    out.resize(kKinds);
    int side = prefill ? 0 : 1;
    for (int i = 0; i < kKinds; ++i) {
        const Kind &k = kKindTable[i];
        Pool &p = out[i];
        sg_kv_layout_init(&p.layout);
        p.layout.num_layers = k.layers;
        p.layout.num_kv_heads = k.heads;
        p.layout.head_dim = k.dim;
        p.layout.tokens_per_block = k.tpb;
        p.layout.num_blocks = k.blocks + k.extra[side];
        p.layout.dtype = k.dtype;
        p.layout.packing = k.pack[side];
        p.layout.block_order = k.order[side];
        p.vec = size_t(k.dim) * sg_dtype_size(k.dtype);
        p.plane = uint64_t(k.tpb) * k.heads * p.vec;
        uint64_t natural = p.layout.packing == SG_KV_FUSED ? 2 * p.plane : p.plane;
        p.stride = natural + k.pad[side];
        p.layout.block_stride_bytes = k.pad[side] ? p.stride : 0;
        uint64_t region = p.stride * p.layout.num_blocks;
        int planes = p.layout.packing == SG_KV_FUSED ? 1 : 2;
        p.mem.assign(size_t(region) * planes * k.layers, 0);
        for (uint32_t l = 0; l < k.layers; ++l) {
            unsigned char *b = p.mem.data() + size_t(region) * planes * l;
            p.kbase.push_back(b);
            if (planes == 2) p.vbase.push_back(b + region);
        }
        p.layout.layer_k_base = p.kbase.data();
        p.layout.layer_v_base = planes == 2 ? p.vbase.data() : nullptr;
        p.layout.layer_base_count = k.layers;
        sg_error_info_t err;
        sg_error_info_init(&err);
        if (sg_kv_register(ctx, &p.layout, &p.handle, &err) != SG_OK) {
            std::fprintf(stderr, "smartgen-soak: sg_kv_register kind %d: %s\n", i, err.message);
            return false;
        }
    }
    return true;
}

void destroy_pools(std::vector<Pool> &pools) {
    for (auto &p : pools) sg_kv_deregister(p.handle);
    pools.clear();
}

std::vector<uint32_t> block_table(const Config &c, const Pool &p, const Spec &sp, uint64_t skey, uint64_t n,
                                  bool prefill) {
    Rng r(mix(c.seed, skey, n, prefill ? 1 : 2));
    uint32_t w = uint32_t(n % uint64_t(c.window));
    std::vector<uint32_t> ids;
    for (uint32_t b = w; b < p.layout.num_blocks; b += uint32_t(c.window)) ids.push_back(b);
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[r.below(i)]);
    size_t need = size_t((sp.tokens + p.layout.tokens_per_block - 1) / p.layout.tokens_per_block);
    ids.resize(need);
    return ids;
}

// ---- pattern ---------------------------------------------------------------------------------------
static void pattern(const Spec &sp, uint32_t layer, int kv, uint64_t token, uint32_t head, size_t len,
                    unsigned char *out) {
    uint64_t key = mix(sp.req_hash, layer, (token << 1) | uint64_t(kv), head);
    for (size_t w = 0; w * 8 < len; ++w) {
        uint64_t x = splitmix(key + w);
        std::memcpy(out + w * 8, &x, 8);
    }
}

void fill_layer(const Pool &p, const Spec &sp, const std::vector<uint32_t> &table, uint32_t layer) {
    const uint32_t tpb = p.layout.tokens_per_block;
    for (size_t i = 0; i < table.size(); ++i)
        for (int kv = 0; kv < 2; ++kv)
            for (uint32_t j = 0; j < tpb; ++j)
                for (uint32_t h = 0; h < p.layout.num_kv_heads; ++h)
                    pattern(sp, layer, kv, i * tpb + j, h, p.vec, p.vector(layer, table[i], kv, j, h));
}

void poison(const Pool &p, const std::vector<uint32_t> &table) {
    const uint32_t tpb = p.layout.tokens_per_block;
    for (uint32_t l = 0; l < p.layout.num_layers; ++l)
        for (uint32_t b : table)
            for (int kv = 0; kv < 2; ++kv)
                for (uint32_t j = 0; j < tpb; ++j)
                    for (uint32_t h = 0; h < p.layout.num_kv_heads; ++h)
                        std::memset(p.vector(l, b, kv, j, h), kPoison, p.vec);
}

uint64_t verify_blocks(const Pool &p, const Spec &sp, const std::vector<uint32_t> &table, uint32_t layer,
                       const std::vector<uint32_t> &blocks, std::string *bad) {
    const uint32_t tpb = p.layout.tokens_per_block;
    unsigned char want[512], poisoned[512];
    std::memset(poisoned, kPoison, sizeof poisoned);
    uint64_t bytes = 0;
    size_t count = blocks.empty() ? table.size() : blocks.size();
    for (size_t bi = 0; bi < count; ++bi) {
        uint32_t i = blocks.empty() ? uint32_t(bi) : blocks[bi];
        for (int kv = 0; kv < 2; ++kv)
            for (uint32_t j = 0; j < tpb; ++j) {
                uint64_t t = uint64_t(i) * tpb + j;
                for (uint32_t h = 0; h < p.layout.num_kv_heads; ++h) {
                    const unsigned char *got = p.vector(layer, table[i], kv, j, h);
                    const unsigned char *exp = poisoned;
                    if (t < sp.tokens) {
                        pattern(sp, layer, kv, t, h, p.vec, want);
                        exp = want;
                    }
                    if (std::memcmp(got, exp, p.vec) != 0) {
                        size_t off = 0;
                        while (got[off] == exp[off]) ++off;
                        char m[256];
                        std::snprintf(m, sizeof m,
                                      "wrong byte: layer %u logical block %u (pool block %u) %s token %llu head %u "
                                      "byte %zu: got 0x%02x want 0x%02x%s",
                                      layer, i, table[i], kv ? "V" : "K", (unsigned long long)t, h, off, got[off],
                                      exp[off], t < sp.tokens ? "" : " (slot past num_tokens written)");
                        *bad = m;
                        return bytes;
                    }
                    if (t < sp.tokens) bytes += p.vec;
                }
            }
    }
    return bytes;
}

// ---- resources and helpers ---------------------------------------------------------------------------
Resources sample(const std::vector<sg_context_t> &ctxs) {
    Resources r;
    if (FILE *f = std::fopen("/proc/self/statm", "r")) {
        unsigned long long size = 0, res = 0;
        if (std::fscanf(f, "%llu %llu", &size, &res) == 2) r.rss = res * uint64_t(sysconf(_SC_PAGESIZE));
        std::fclose(f);
    }
    if (DIR *d = opendir("/proc/self/fd")) {
        while (dirent *e = readdir(d))
            if (e->d_name[0] != '.') ++r.fds;
        closedir(d);
        r.fds -= 1;  // the directory's own descriptor
    }
    for (sg_context_t c : ctxs) {
        sg_context_stats_t st;
        sg_context_stats_init(&st);
        if (sg_context_stats(c, &st) == SG_OK) r.registrations += st.registrations;
    }
    return r;
}

// "socket:[inode]" alone cannot tell a kept connection from a half-closed one: add the tcp state and
// ports from /proc/net/tcp{,6} so the report says what each leftover socket is.
static std::map<std::string, std::string> tcp_sockets() {
    static const char *const states[] = {"?",         "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
                                         "TIME_WAIT", "CLOSE",       "CLOSE_WAIT", "LAST_ACK", "LISTEN",  "CLOSING"};
    std::map<std::string, std::string> out;
    for (const char *path : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
        FILE *f = std::fopen(path, "r");
        if (!f) continue;
        char line[512];
        if (!std::fgets(line, sizeof line, f)) {  // header
            std::fclose(f);
            continue;
        }
        while (std::fgets(line, sizeof line, f)) {
            char local[64], remote[64];
            unsigned state = 0;
            unsigned long long inode = 0;
            if (std::sscanf(line, " %*d: %63s %63s %x %*s %*s %*s %*s %*s %llu", local, remote, &state, &inode) != 4)
                continue;
            auto port = [](const char *a) {
                const char *colon = std::strrchr(a, ':');
                return colon ? std::to_string(std::strtoul(colon + 1, nullptr, 16)) : std::string("?");
            };
            out["socket:[" + std::to_string(inode) + "]"] =
                std::string(" tcp ") + (state < 12 ? states[state] : "?") + " " + port(local) + "->" + port(remote);
        }
        std::fclose(f);
    }
    return out;
}

std::vector<std::pair<int, std::string>> fd_table() {
    const auto tcp = tcp_sockets();
    std::vector<std::pair<int, std::string>> out;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return out;
    const int self = dirfd(d);
    while (dirent *e = readdir(d)) {
        if (e->d_name[0] == '.' || std::atoi(e->d_name) == self) continue;
        char path[320], target[256];
        std::snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
        auto t = tcp.find(target);
        out.push_back({std::atoi(e->d_name), t == tcp.end() ? std::string(target) : target + t->second});
    }
    closedir(d);
    std::sort(out.begin(), out.end());
    return out;
}

uint64_t now_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
}
void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// The soak's pre-shared key: every context of the run authenticates with it (loopback only).
static const char kSoakKey[] = "smartgen-soak-key-not-a-secret-0123456789abcdef";

static void log_sink(void *user, sg_log_level_t level, const char *message) {
    const char *tag = static_cast<const char *>(user);
    std::fprintf(stderr, "[%s] sg %s: %s\n", tag, level == SG_LOG_ERROR ? "error" : "warn", message);
}

sg_context_t make_context(const char *provider, const std::string &tag) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider;
    o.local_addr = "127.0.0.1";
    o.auth_key = kSoakKey;
    o.auth_key_len = sizeof kSoakKey - 1;
    o.log_level = SG_LOG_ERROR;
    o.log_fn = log_sink;
    static std::mutex mu;
    static std::list<std::string> tags;  // the sink's user pointers outlive their contexts
    {
        std::lock_guard<std::mutex> g(mu);
        tags.push_back(tag);
        o.log_user = const_cast<char *>(tags.back().c_str());
    }
    sg_context_t ctx = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    if (sg_context_create(&o, &ctx, &err) != SG_OK) {
        std::fprintf(stderr, "[%s] sg_context_create(%s): %s\n", tag.c_str(), provider, err.message);
        return nullptr;
    }
    return ctx;
}

}  // namespace soak
