// examples/disagg/calibrate: see calibrate.hpp for what is measured and the stats schema.
#include "calibrate.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace sg::disagg {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw EngineError("calibrate: " + msg); }

// runtime/select's fraction_of: ceil(f * n), except that a product within 1e-9 of an integer is that
// integer (so 0.25 * 64 is 16, not 17 after rounding noise).
uint64_t fraction_of(double f, uint64_t n) {
    const double x = f * double(n);
    const double r = std::round(x);
    if (std::fabs(x - r) <= 1e-9 * std::max(1.0, x)) return uint64_t(r);
    return uint64_t(std::ceil(x));
}

double round6(double x) { return std::round(x * 1e6) / 1e6; }

// Per (layer, KV head): every row's recall at every budget, and running diffuseness sums.
struct Accumulator {
    std::vector<double> recall;  // [row][budget]
    uint64_t rows = 0;
    double entropy = 0.0, effective = 0.0;
};

class Collector {
  public:
    Collector(const std::vector<double>& budgets, uint32_t block_tokens, uint64_t sinks, uint64_t recent)
        : budgets_(budgets), block_tokens_(block_tokens), sinks_(sinks), recent_(recent) {}

    // mass: per block of the t visible prompt tokens; free: mass that is attended regardless.
    void add_row(Accumulator& acc, std::span<const double> mass, double free, uint64_t t) {
        const uint64_t n = mass.size(), B = block_tokens_;
        // The selector's sink blocks [0, sink_end) and recent window [recent_from, n).
        const uint64_t sink_end = std::min<uint64_t>(n, (sinks_ + B - 1) / B);
        uint64_t recent_from = n;
        if (recent_ > 0) recent_from = recent_ >= t ? 0 : (t - recent_) / B;
        recent_from = std::max(recent_from, sink_end);
        const uint64_t forced = sink_end + (n - recent_from);
        double forced_mass = 0.0;
        for (uint64_t j = 0; j < sink_end; ++j) forced_mass += mass[j];
        for (uint64_t j = recent_from; j < n; ++j) forced_mass += mass[j];
        sorted_.assign(mass.begin() + ptrdiff_t(sink_end), mass.begin() + ptrdiff_t(recent_from));
        std::sort(sorted_.begin(), sorted_.end(), std::greater<double>());
        const size_t m = sorted_.size();
        prefix_.resize(m + 1);
        prefix_[0] = free + forced_mass;
        for (size_t j = 0; j < m; ++j) prefix_[j + 1] = prefix_[j] + sorted_[j];
        const double total = prefix_[m];
        for (double f : budgets_) {
            const uint64_t k = calibration_budget_blocks(f, t, block_tokens_);
            const uint64_t take = std::min<uint64_t>(m, std::max(k, forced) - forced);
            acc.recall.push_back(total > 0.0 ? prefix_[take] / total : 1.0);
        }
        double s = 0.0;
        for (double x : mass) s += x;
        double h = 0.0;
        if (s > 0.0)
            for (double x : mass)
                if (x > 0.0) h -= (x / s) * std::log(x / s);
        acc.entropy += n > 1 ? h / std::log(double(n)) : 0.0;
        acc.effective += std::exp(h) / double(n);
        acc.rows++;
    }

  private:
    const std::vector<double>& budgets_;
    uint32_t block_tokens_;
    uint64_t sinks_, recent_;
    std::vector<double> sorted_, prefix_;
};

std::vector<double> default_budgets() {
    std::vector<double> b;
    for (int k = 1; k <= 64; ++k) b.push_back(double(k) / 64.0);
    return b;
}

}  // namespace

uint64_t calibration_budget_blocks(double f, uint64_t t, uint32_t block_tokens) {
    const uint64_t tokens = fraction_of(f, t);
    const uint64_t all = (t + block_tokens - 1) / block_tokens;
    return std::min(all, (tokens + block_tokens - 1) / block_tokens);
}

std::vector<std::vector<int>> load_prompts(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot read prompts from " + path);
    nlohmann::json j;
    try {
        in >> j;
    } catch (const std::exception& e) {
        fail(path + ": " + e.what());
    }
    if (!j.is_array()) fail(path + ": expected a JSON array of prompts");
    std::vector<std::vector<int>> prompts;
    for (size_t i = 0; i < j.size(); ++i) {
        const auto& o = j[i];
        const char* key = o.is_object() && o.contains("tokens") ? "tokens" : "prompt";
        if (!o.is_object() || !o.contains(key) || !o[key].is_array())
            fail(path + ": [" + std::to_string(i) + "] needs \"tokens\" (or \"prompt\"): an array of token ids");
        std::vector<int> p;
        for (const auto& t : o[key]) {
            if (!t.is_number_integer()) fail(path + ": [" + std::to_string(i) + "]." + key + ": ids must be integers");
            p.push_back(t.get<int>());
        }
        if (p.empty()) fail(path + ": [" + std::to_string(i) + "]." + key + " is empty");
        prompts.push_back(std::move(p));
    }
    return prompts;
}

CalibrationStats calibrate(const Model& model, const std::string& model_name, std::span<const std::vector<int>> prompts,
                           const CalibrationOptions& options) {
    const Config& c = model.config();
    const int B = options.block_tokens;
    if (B < 1) fail("block_tokens must be >= 1");
    if (options.steps < 0 || options.window < 0 || options.sinks < 0 || options.recent < 0)
        fail("steps, window, sinks and recent must be >= 0");
    if (prompts.empty()) fail("no prompts");
    const std::vector<double> budgets = options.budgets.empty() ? default_budgets() : options.budgets;
    for (size_t i = 0; i < budgets.size(); ++i)
        if (!(budgets[i] > 0.0 && budgets[i] <= 1.0) || (i && budgets[i] <= budgets[i - 1]))
            fail("budgets must be ascending fractions in (0, 1]");
    if (budgets.back() != 1.0) fail("the last budget must be 1");

    CalibrationStats st;
    st.model = model_name;
    st.shape = c;
    st.block_tokens = B;
    st.steps = options.steps;
    st.window = options.window;
    st.sinks = options.sinks;
    st.recent = options.recent;
    st.prompts = int(prompts.size());
    st.budgets = budgets;

    const int L = c.n_layers, G = c.n_kv_heads, hs = c.head_size(), mul = c.kv_mul();
    std::vector<Accumulator> acc(size_t(L) * G);
    Collector collector(budgets, uint32_t(B), uint64_t(options.sinks), uint64_t(options.recent));

    KvPoolStorage storage(c, B, blocks_for(c.seq_len, B));
    const KvPool& pool = storage.view();
    const auto table = identity_table(blocks_for(c.seq_len, B));
    RunState state(c);
    PrefillCapture capture;
    AttentionProbe probe;
    std::vector<double> keys, scores, combined, mass;

    // Block masses over the first t positions of a combined row; the rest of the row is free mass.
    auto add = [&](int l, int g, std::span<const double> row, uint64_t t) {
        const uint64_t n = (t + uint64_t(B) - 1) / uint64_t(B);
        mass.assign(n, 0.0);
        for (uint64_t u = 0; u < t; ++u) mass[u / uint64_t(B)] += row[u];
        double free = 0.0;
        for (size_t u = t; u < row.size(); ++u) free += row[u];
        collector.add_row(acc[size_t(l) * G + g], mass, free, t);
    };

    uint64_t total_tokens = 0;
    st.min_prompt_tokens = c.seq_len + 1;
    for (const auto& prompt : prompts) {
        const int n = int(prompt.size());
        if (n > c.seq_len)
            fail("a prompt of " + std::to_string(n) + " tokens exceeds the context of " + std::to_string(c.seq_len));
        st.min_prompt_tokens = std::min(st.min_prompt_tokens, n);
        st.max_prompt_tokens = std::max(st.max_prompt_tokens, n);
        total_tokens += uint64_t(n);

        PrefillOptions po;
        po.window = options.window;
        po.capture = options.window > 0 ? &capture : nullptr;
        const auto logits = prefill(model, pool, table, prompt, state, po);
        int next = argmax(logits);

        // Window rows: query t = n - W + r over keys 0..t, recomputed in double.
        const int W = options.window > 0 ? capture.window : 0;
        const double scale = 1.0 / std::sqrt(double(hs));
        for (int l = 0; l < L && W > 0; ++l) {
            keys.resize(size_t(G) * n * hs);
            std::vector<float> k(static_cast<size_t>(hs));
            for (int g = 0; g < G; ++g)
                for (int u = 0; u < n; ++u) {
                    read_kv(pool, table, l, false, u, g, k.data());
                    std::copy(k.begin(), k.end(), keys.begin() + (size_t(g) * n + u) * hs);
                }
            for (int r = 0; r < W; ++r) {
                const int t = n - W + r;
                for (int g = 0; g < G; ++g) {
                    combined.assign(size_t(t) + 1, 0.0);
                    for (int h = g * mul; h < (g + 1) * mul; ++h) {
                        const float* q = capture.query(l, h, r);
                        scores.resize(size_t(t) + 1);
                        double mx = -INFINITY;
                        for (int u = 0; u <= t; ++u) {
                            const double* kk = keys.data() + (size_t(g) * n + u) * hs;
                            double s = 0.0;
                            for (int i = 0; i < hs; ++i) s += double(q[i]) * kk[i];
                            scores[size_t(u)] = s * scale;
                            mx = std::max(mx, scores[size_t(u)]);
                        }
                        double z = 0.0;
                        for (double& s : scores) z += (s = std::exp(s - mx));
                        for (int u = 0; u <= t; ++u) combined[size_t(u)] += scores[size_t(u)] / z / double(mul);
                    }
                    add(l, g, combined, uint64_t(t) + 1);
                }
            }
        }
        st.window_rows += uint64_t(W);

        // Decode rows: greedy continuation with the true attention of each step.
        const int steps = std::min(options.steps, c.seq_len - n);
        for (int s = 0; s < steps; ++s) {
            const int pos = n + s;
            const auto step_logits = decode_step(model, pool, table, pos, next, state, nullptr, &probe);
            for (int l = 0; l < L; ++l)
                for (int g = 0; g < G; ++g) {
                    combined.assign(size_t(probe.n_pos), 0.0);
                    for (int h = g * mul; h < (g + 1) * mul; ++h) {
                        const float* p = probe.row(l, h);
                        for (int u = 0; u < probe.n_pos; ++u) combined[size_t(u)] += double(p[u]) / double(mul);
                    }
                    add(l, g, combined, uint64_t(n));
                }
            next = argmax(step_logits);
            st.decode_rows++;
        }
    }
    st.mean_prompt_tokens = double(total_tokens) / double(prompts.size());

    const size_t nb = budgets.size();
    std::vector<double> column;
    for (int l = 0; l < L; ++l)
        for (int g = 0; g < G; ++g) {
            const Accumulator& a = acc[size_t(l) * G + g];
            HeadCalibration hc;
            hc.layer = l;
            hc.kv_head = g;
            hc.rows = a.rows;
            for (size_t b = 0; b < nb; ++b) {
                column.clear();
                double sum = 0.0;
                for (uint64_t r = 0; r < a.rows; ++r) {
                    column.push_back(a.recall[r * nb + b]);
                    sum += column.back();
                }
                std::sort(column.begin(), column.end());
                const size_t rank = std::max<size_t>(1, size_t(std::ceil(0.1 * double(column.size()))));
                hc.recall_mean.push_back(a.rows ? round6(sum / double(a.rows)) : 1.0);
                hc.recall_p10.push_back(a.rows ? round6(column[rank - 1]) : 1.0);
            }
            hc.entropy = a.rows ? round6(a.entropy / double(a.rows)) : 0.0;
            hc.effective_fraction = a.rows ? round6(a.effective / double(a.rows)) : 1.0;
            st.heads.push_back(std::move(hc));
        }
    return st;
}

std::string CalibrationStats::to_json() const {
    using ojson = nlohmann::ordered_json;
    auto dump = [](const ojson& j) { return j.dump(); };
    std::ostringstream os;
    os << "{\n";
    os << "  \"schema\": \"smartgen-calibration-stats\",\n  \"version\": 1,\n";
    os << "  \"model\": " << dump(model) << ",\n";
    os << "  \"shape\": "
       << dump(ojson{{"num_layers", shape.n_layers},
                     {"num_heads", shape.n_heads},
                     {"num_kv_heads", shape.n_kv_heads},
                     {"head_dim", shape.head_size()},
                     {"seq_len", shape.seq_len}})
       << ",\n";
    os << "  \"block_tokens\": " << block_tokens << ",\n  \"combine\": \"sum\",\n";
    os << "  \"sinks\": " << sinks << ",\n  \"recent\": " << recent << ",\n";
    os << "  \"steps\": " << steps << ",\n  \"window\": " << window << ",\n";
    os << "  \"prompts\": " << prompts << ",\n";
    os << "  \"prompt_tokens\": "
       << dump(ojson{{"min", min_prompt_tokens}, {"max", max_prompt_tokens}, {"mean", round6(mean_prompt_tokens)}})
       << ",\n";
    os << "  \"rows\": " << dump(ojson{{"decode", decode_rows}, {"window", window_rows}}) << ",\n";
    os << "  \"budgets\": " << dump(budgets) << ",\n";
    os << "  \"heads\": [\n";
    for (size_t i = 0; i < heads.size(); ++i) {
        const HeadCalibration& h = heads[i];
        os << "    "
           << dump(ojson{{"layer", h.layer},
                         {"kv_head", h.kv_head},
                         {"rows", h.rows},
                         {"recall_mean", h.recall_mean},
                         {"recall_p10", h.recall_p10},
                         {"entropy", h.entropy},
                         {"effective_fraction", h.effective_fraction}})
           << (i + 1 < heads.size() ? ",\n" : "\n");
    }
    os << "  ]\n}\n";
    return os.str();
}

}  // namespace sg::disagg
