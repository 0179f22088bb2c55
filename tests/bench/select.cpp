// smartgen-microbench select (internal: it links the runtime's select/ folder and kernels, not
// libsmartgen): throughput of the selection kernels on one thread, against a one-thread memcpy of the
// same bytes measured in the same invocation (alternated pass by pass, medians).
//
// Keys are fp16, Llama-3-8B shaped (8 KV heads, 32 query heads, head_dim 128, 16-token blocks),
// token-major and packed: one View over the whole buffer, which is what one call per block of a
// paged pool computes (tests/unit/select_test.cpp checks the two agree).
//
//   quest digest+score  page_digest over the keys, then quest_scores of one decode query over the
//                       digests: key bytes / (digest + score time). At the largest buffer this is P6
//                       (target >= 0.5 of memcpy).
//   quest digest        page_digest alone, key bytes / time.
//   quest score         quest_scores alone, digest bytes / time (the per-step cost at decode).
//   h2o                 h2o_scores over fp32 accumulators of the same byte size, [32 heads][tokens].
//   snapkv              snapkv_scores of a window of --window queries over the keys: compute-bound
//                       (window x 32 heads dot products per key row), reported for scale.
//   select sinks_recent / select quest
//                       Selector::select_layer for one layer (8 heads), sinks and recent only or top-k
//                       of Quest scores at budget 1/8: there is no scoring kernel, so the figure is
//                       the time against memcpy of that layer's keys (ratio = memcpy time / time).
//
// Flags: --bytes N (largest buffer, default 256M), --reps N (>= 5, default 7; --quick 5),
//        --window N (SnapKV queries, default 16; --quick 4), --policies a,b,... (default all),
//        --isa portable|avx2|avx512 (the page digest and Quest variant; default the widest this CPU
//        has), so one binary measures each variant in the same sitting.
#include "select/select.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include "bench.hpp"
#include "cpu/variants.hpp"
#include "kernels.hpp"

namespace sg::bench {

namespace {

constexpr uint32_t kKvHeads = 8, kQueryHeads = 32, kHeadDim = 128, kBlockTokens = 16;
constexpr uint64_t kTokenBytes = uint64_t(kKvHeads) * kHeadDim * 2;  // fp16 K of one token, all KV heads
constexpr const char *kBaseline = "memcpy (1 thread)";

struct Buffer {
    std::unique_ptr<uint8_t[]> mem;
    uint8_t *data = nullptr;
    uint64_t bytes = 0;
    explicit Buffer(uint64_t n) : mem(new uint8_t[n + 64]), bytes(n) {
        data = mem.get() + (64 - reinterpret_cast<uintptr_t>(mem.get()) % 64) % 64;
        std::memset(data, 0, n);  // fault the pages in before anything is timed
    }
    template <class T>
    T *as() const {
        return reinterpret_cast<T *>(data);
    }
};

// xorshift64*: fills hundreds of MiB quickly; values in [-scale, scale).
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed | 1) {}
    uint64_t next() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        return s * 0x2545f4914f6cdd1dull;
    }
    float uniform(float scale) { return (float(next() >> 40) / float(1u << 24) * 2.f - 1.f) * scale; }
};

double seconds_of(const std::function<void()> &fn) {
    const uint64_t t0 = now_ns();
    fn();
    return double(now_ns() - t0) * 1e-9;
}

// Alternates a memcpy of `copy_bytes` with one call of `fn`, `reps` times: {memcpy s, fn s} medians.
struct Timing {
    double memcpy_s, run_s;
};
Timing alternate(const Buffer &src, Buffer &dst, uint64_t copy_bytes, int reps, const std::function<void()> &fn) {
    std::vector<double> mc, run;
    fn();  // warm-up: first touch of outputs and scratch
    for (int r = 0; r < reps; ++r) {
        mc.push_back(seconds_of([&] { std::memcpy(dst.data, src.data, copy_bytes); }));
        run.push_back(seconds_of(fn));
    }
    return {median(mc), median(run)};
}

std::string mib(uint64_t bytes) { return human_bytes(bytes); }

std::vector<std::string> split(const std::string &s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');)
        if (!item.empty()) out.push_back(item);
    return out;
}

select::Profile profile_of(select::Policy policy) {
    select::Profile p;
    p.model = "llama-3-8b";
    p.num_layers = 1;
    p.num_kv_heads = kKvHeads;
    p.block_tokens = kBlockTokens;
    p.defaults.policy = policy;
    p.defaults.budget = select::Budget::of_fraction(0.125);
    p.defaults.sinks = 16;
    p.defaults.recent = policy == select::Policy::sinks_recent ? 4096 : 64;
    return p;
}

}  // namespace

int run_select(const Common &c) {
    Flags flags("select", c.rest);
    uint64_t max_bytes = 256ull << 20;
    int reps = c.quick ? 5 : 7;
    uint64_t window = c.quick ? 4 : 16;
    std::set<std::string> policies = {"quest", "h2o", "snapkv", "sinks_recent"};
    using kernels::cpu::Isa;
    Isa isa = kernels::cpu::best_isa();
    try {
        if (auto v = flags.take("--isa")) {
            bool known = false;
            for (const Isa i : {Isa::portable, Isa::avx2, Isa::avx512})
                if (*v == kernels::cpu::isa_name(i)) isa = i, known = true;
            if (!known) throw std::invalid_argument("--isa: portable, avx2 or avx512, got '" + *v + "'");
            if (!kernels::cpu::isa_supported(isa)) throw std::invalid_argument("--isa: this CPU has no " + *v);
        }
        if (auto v = flags.take("--bytes")) max_bytes = parse_bytes(*v);
        if (auto v = flags.take("--reps")) reps = std::stoi(*v);
        if (auto v = flags.take("--window")) window = std::stoull(*v);
        if (auto v = flags.take("--policies")) {
            const auto list = split(*v);
            policies = {list.begin(), list.end()};
        }
    } catch (const std::exception &e) {
        std::fprintf(stderr, "smartgen-microbench select: %s\n", e.what());
        return 2;
    }
    flags.finish();
    for (const std::string &p : policies)
        if (p != "quest" && p != "h2o" && p != "snapkv" && p != "sinks_recent") {
            std::fprintf(stderr,
                         "smartgen-microbench select: --policies: unknown policy '%s' (quest, h2o, snapkv, sinks_recent)\n",
                         p.c_str());
            return 2;
        }
    if (reps < 5) {
        std::fprintf(stderr, "smartgen-microbench select: --reps: at least 5 (medians of >= 5), got %d\n", reps);
        return 2;
    }
    if (window < 1) {
        std::fprintf(stderr, "smartgen-microbench select: --window: at least 1\n");
        return 2;
    }
    const uint64_t max_tokens = max_bytes / kTokenBytes / kBlockTokens * kBlockTokens;
    if (max_tokens < kBlockTokens) {
        std::fprintf(stderr, "smartgen-microbench select: --bytes: at least %s\n", mib(kTokenBytes * kBlockTokens).c_str());
        return 2;
    }
    max_bytes = max_tokens * kTokenBytes;
    if (max_bytes < (256ull << 20))
        progress("select", "note: --bytes below 256 MiB measures caches as much as DRAM; P6 is defined at >= 256 MiB");

    // Sizes of the sweep: the largest buffer and quarters of it down to 1/16 (1/4 with --quick).
    std::vector<uint64_t> sizes;
    for (uint64_t t = max_tokens, k = 0; k < (c.quick ? 2u : 3u) && t >= kBlockTokens; ++k, t /= 4)
        sizes.insert(sizes.begin(), t / kBlockTokens * kBlockTokens);

    progress("select",
             "filling " + mib(max_bytes) + " of fp16 keys (Llama-3-8B: 8 KV heads, head_dim 128, 16-token blocks)");
    Buffer keys(max_bytes), copy_dst(max_bytes);
    {
        Rng rng(42);
        uint16_t *k = keys.as<uint16_t>();
        for (uint64_t i = 0; i < max_bytes / 2; ++i) k[i] = kernels::float_to_fp16(rng.uniform(4.f));
    }
    const uint64_t max_blocks = max_tokens / kBlockTokens;
    Buffer digest(kernels::digest_floats(max_blocks, kKvHeads, kHeadDim) * sizeof(float));
    std::vector<float> scores(max_blocks * kKvHeads);
    std::vector<uint16_t> query(kQueryHeads * kHeadDim);
    {
        Rng rng(7);
        for (auto &q : query) q = kernels::float_to_fp16(rng.uniform(1.f));
    }
    const kernels::View qview = kernels::token_major(query.data(), kernels::DType::fp16, 1, kQueryHeads, kHeadDim);

    Report report(c);
    uint64_t buffer = 0;  // key bytes of the sweep point being measured (the plot's x)
    auto line = [&](const std::string &op, uint64_t bytes, double gbps, double memcpy_gbps_, const std::string &note) {
        Line l;
        l.extra["buffer_mib"] = double(buffer) / double(1 << 20);
        l.bench = "select";
        l.op = op;
        l.value = gbps;
        l.unit = "GB/s";
        l.baseline_name = kBaseline;
        l.baseline_value = memcpy_gbps_;
        l.ratio = memcpy_gbps_ > 0 ? gbps / memcpy_gbps_ : 0;
        l.total_bytes = bytes;
        l.block_bytes = uint64_t(kBlockTokens) * kTokenBytes;
        l.extra["threads"] = 1;
        l.extra["reps"] = reps;
        l.extra_text["dtype"] = "fp16";
        l.note = note;
        return l;
    };
    auto gb = [](uint64_t bytes, double s) { return s > 0 ? double(bytes) / s * 1e-9 : 0.0; };

    std::optional<Line> p6;
    for (const uint64_t tokens : sizes) {
        const uint64_t bytes = tokens * kTokenBytes, blocks = tokens / kBlockTokens;
        buffer = bytes;
        const kernels::View kv = kernels::token_major(keys.data, kernels::DType::fp16, tokens, kKvHeads, kHeadDim);
        const uint64_t digest_bytes = kernels::digest_floats(blocks, kKvHeads, kHeadDim) * sizeof(float);
        if (policies.count("quest")) {
            progress("select", "quest over " + mib(bytes) + " (" + std::to_string(tokens) + " tokens), " +
                                   std::to_string(reps) + " reps alternated with memcpy, " +
                                   kernels::cpu::isa_name(isa) + " kernels");
            // Each rep times digest and score separately, so the three lines come from the same passes.
            std::vector<double> mc, dg, sc, both;
            for (int r = -1; r < reps; ++r) {  // rep -1 warms up
                const double m = seconds_of([&] { std::memcpy(copy_dst.data, keys.data, bytes); });
                const double d =
                    seconds_of([&] { kernels::cpu::page_digest_on(isa, kv, kBlockTokens, digest.as<float>()); });
                const double s = seconds_of([&] {
                    kernels::cpu::quest_scores_on(isa, digest.as<float>(), blocks, kKvHeads, qview,
                                                  kernels::Combine::max, scores.data());
                });
                if (r < 0) continue;
                mc.push_back(m);
                dg.push_back(d);
                sc.push_back(s);
                both.push_back(d + s);
            }
            const double mgb = gb(bytes, median(mc));
            Line l = line("quest digest+score", bytes, gb(bytes, median(both)), mgb,
                          "key bytes / (page_digest + quest_scores), 32 query heads");
            l.extra["digest_ms"] = median(dg) * 1e3;
            l.extra["score_ms"] = median(sc) * 1e3;
            l.extra["memcpy_ms"] = median(mc) * 1e3;
            l.extra["tokens"] = double(tokens);
            l.extra_text["isa"] = kernels::cpu::isa_name(isa);
            if (tokens == max_tokens && bytes >= (256ull << 20)) {  // P6 is defined at >= 256 MiB
                p6 = l;
                p6->figure = "P6";
                p6->note =
                    "Quest digest+score / memcpy, target >= 0.5: " + std::string(p6->ratio >= 0.5 ? "met" : "MISSED");
            }
            report.add(l);
            // Only the quest lines say which variant ran: the other kernels have one path.
            for (Line q : {line("quest digest", bytes, gb(bytes, median(dg)), mgb, "key bytes / page_digest"),
                           line("quest score", digest_bytes, gb(digest_bytes, median(sc)), gb(bytes, median(mc)),
                                "digest bytes / quest_scores (one decode step)")}) {
                q.extra_text["isa"] = kernels::cpu::isa_name(isa);
                report.add(q);
            }
        }
        if (policies.count("h2o")) {
            // Accumulators of the same byte size: [32 query heads][tokens_h] fp32, summed per block
            // into the 8 KV heads; the memcpy baseline copies the keys (the same number of bytes).
            const uint64_t tokens_h = bytes / (sizeof(float) * kQueryHeads);
            progress("select", "h2o over " + mib(bytes) + " of fp32 accumulators");
            std::vector<float> acc(tokens_h * kQueryHeads);
            {
                Rng rng(11);
                for (auto &a : acc) a = std::fabs(rng.uniform(1.f));
            }
            std::vector<float> out(kernels::num_blocks(tokens_h, kBlockTokens) * kKvHeads);
            const Timing t = alternate(keys, copy_dst, bytes, reps, [&] {
                kernels::h2o_scores(acc.data(), kQueryHeads, tokens_h, tokens_h, kKvHeads, kernels::Combine::sum,
                                    kBlockTokens, out.data());
            });
            Line l = line("h2o", bytes, gb(bytes, t.run_s), gb(bytes, t.memcpy_s),
                          "accumulator bytes / h2o_scores, 32 heads summed into 8");
            l.block_bytes = uint64_t(kBlockTokens) * kQueryHeads * sizeof(float);
            l.extra_text["dtype"] = "fp32";
            report.add(l);
        }
    }
    const uint64_t bytes = max_tokens * kTokenBytes;
    buffer = bytes;
    const kernels::View kv = kernels::token_major(keys.data, kernels::DType::fp16, max_tokens, kKvHeads, kHeadDim);
    if (policies.count("snapkv")) {
        progress("select", "snapkv over " + mib(bytes) + ", window of " + std::to_string(window) + " queries");
        std::vector<uint16_t> wq(window * kQueryHeads * kHeadDim);
        {
            Rng rng(13);
            for (auto &q : wq) q = kernels::float_to_fp16(rng.uniform(1.f));
        }
        const kernels::View qv = kernels::token_major(wq.data(), kernels::DType::fp16, window, kQueryHeads, kHeadDim);
        std::vector<float> scratch(kernels::snapkv_scratch_floats(kv, qv));
        std::vector<float> out(max_blocks * kKvHeads);
        const Timing t = alternate(keys, copy_dst, bytes, reps, [&] {
            kernels::snapkv_scores(kv, qv, max_tokens - window, kernels::Combine::max, kBlockTokens, 7, scratch,
                                   out.data());
        });
        Line l = line("snapkv", bytes, gb(bytes, t.run_s), gb(bytes, t.memcpy_s),
                      "key bytes / snapkv_scores, window " + std::to_string(window) + " x 32 heads (compute-bound)");
        l.extra["window"] = double(window);
        report.add(l);
    }
    // Selection proper: one layer's Selector::select_layer, against memcpy of that layer's keys.
    for (const auto &[name, policy] :
         {std::pair{"sinks_recent", select::Policy::sinks_recent}, std::pair{"quest", select::Policy::quest}}) {
        if (!policies.count(name)) continue;
        progress("select", std::string("select_layer (") + name + ") over " + std::to_string(max_blocks) + " blocks");
        const select::Selector sel(profile_of(policy), {max_tokens, 2ull * kHeadDim * 2});
        if (policy == select::Policy::quest) {
            kernels::page_digest(kv, kBlockTokens, digest.as<float>());
            kernels::quest_scores(digest.as<float>(), max_blocks, kKvHeads, qview, kernels::Combine::max,
                                  scores.data());
        }
        select::LayerSelection out;
        const std::span<const float> sc =
            sel.needs_scores(0) ? std::span<const float>(scores) : std::span<const float>();
        const Timing t = alternate(keys, copy_dst, bytes, reps, [&] { sel.select_layer(0, sc, out); });
        Line l;
        l.bench = "select";
        l.op = std::string("select ") + name;
        l.value = t.run_s * 1e3;
        l.unit = "ms";
        l.baseline_name = "memcpy of the layer's keys (1 thread)";
        l.baseline_value = t.memcpy_s * 1e3;
        l.ratio = t.run_s > 0 ? t.memcpy_s / t.run_s : 0;
        l.total_bytes = bytes;
        l.block_bytes = uint64_t(kBlockTokens) * kTokenBytes;
        l.extra["threads"] = 1;
        l.extra["reps"] = reps;
        l.extra["blocks"] = double(max_blocks);
        l.extra["selected_blocks"] = double(out.blocks.size());
        l.extra_text["dtype"] = "fp16";
        l.note = std::string("Selector::select_layer, 8 heads, budget 1/8") +
                 (policy == select::Policy::quest ? " (top-k of Quest scores)" : " (sinks + recent window)") +
                 "; ratio = memcpy time / time";
        report.add(l);
    }
    if (p6) {
        report.add(*p6);
        if (p6->ratio < 0.5) progress("select", "P6 MISSED: quest digest+score is below 0.5 of memcpy");
    }
    if (!c.json) report.print_table();
    if (!c.plot.empty())
        report.plot(
            "smartgen-microbench select: 1 thread, fp16 keys (Llama-3-8B shape); memcpy baselines in the table",
            "key buffer (MiB)", "GB/s",
            [](const Line &l) {
                // Bandwidths only; select_layer times (ms) are in the table.
                return l.unit == "GB/s" ? l.extra.at("buffer_mib") : std::nan("");
            },
            [](const Line &l) { return l.op.value_or("?"); });
    return 0;
}

}  // namespace sg::bench
