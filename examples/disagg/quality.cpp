// examples/disagg/quality: see quality.hpp for what is decoded, the oracle and the metrics.
#include "quality.hpp"
#include "pool_layout.hpp"

#include <smartgen/smartgen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <sstream>

namespace sg::disagg {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw EngineError("quality: " + msg); }

void check(sg_status_t st, const char* call, const sg_error_info_t* err = nullptr) {
    if (st == SG_OK) return;
    const char* detail = err && err->message[0] ? err->message : sg_last_error_message();
    fail(std::string(call) + ": " + sg_status_str(st) + (detail && *detail ? std::string(": ") + detail : ""));
}

std::string format(const char* f, double x) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, x);
    return buf;
}


// The prompt's KV as a decode side receives it with in-flight quantization: positions 0..n-1 of
// every layer moved from src to dst (same shape, identity tables) by a full-path transfer with
// options.wire_quant, between two contexts of this process joined by their metadata blobs.
std::pair<uint64_t, uint64_t> deliver(const KvPool& src, const KvPool& dst, int n_tokens, int block_tokens,
                                      uint32_t wire_quant) {
    struct Ctx {
        sg_context_t c = nullptr;
        ~Ctx() { if (c) sg_context_destroy(c); }
    } prefill, decode;
    struct Kv {
        sg_kv_handle_t h = nullptr;
        ~Kv() { if (h) sg_kv_deregister(h); }
    };
    sg_error_info_t err;
    for (Ctx* x : {&prefill, &decode}) {
        sg_context_options_t o;
        sg_context_options_init(&o);
        o.allow_unauthenticated = 1;  // both ends are this process
        o.log_level = SG_LOG_OFF;
        sg_error_info_init(&err);
        check(sg_context_create(&o, &x->c, &err), "sg_context_create", &err);
    }
    auto blob = [](sg_context_t c) {
        size_t len = 0;
        sg_context_get_metadata(c, nullptr, 0, &len);
        std::vector<uint8_t> b(len);
        check(sg_context_get_metadata(c, b.data(), b.size(), &len), "sg_context_get_metadata");
        return b;
    };
    const auto pb = blob(prefill.c), db = blob(decode.c);
    sg_session_t at_prefill = nullptr, at_decode = nullptr;
    sg_error_info_init(&err);
    check(sg_session_from_metadata(prefill.c, db.data(), db.size(), nullptr, &at_prefill, &err), "sg_session_from_metadata", &err);
    sg_error_info_init(&err);
    check(sg_session_from_metadata(decode.c, pb.data(), pb.size(), nullptr, &at_decode, &err), "sg_session_from_metadata", &err);
    check(sg_session_wait_ready(at_prefill, 10'000'000'000ull), "sg_session_wait_ready");
    check(sg_session_wait_ready(at_decode, 10'000'000'000ull), "sg_session_wait_ready");
    Kv src_kv, dst_kv;
    const sg_kv_layout_t sl = layout_of(src), dl = layout_of(dst);
    sg_error_info_init(&err);
    check(sg_kv_register(prefill.c, &sl, &src_kv.h, &err), "sg_kv_register", &err);
    sg_error_info_init(&err);
    check(sg_kv_register(decode.c, &dl, &dst_kv.h, &err), "sg_kv_register", &err);
    check(sg_session_export_kv(at_prefill, src_kv.h), "sg_session_export_kv");
    check(sg_session_export_kv(at_decode, dst_kv.h), "sg_session_export_kv");
    const auto table = identity_table(blocks_for(n_tokens, block_tokens));
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.wire_quant = wire_quant;
    sg_transfer_t x_decode = nullptr, x_prefill = nullptr;
    sg_error_info_init(&err);
    check(sg_transfer_expect(at_decode, "prompt", dst_kv.h, table.data(), table.size(), uint64_t(n_tokens), &o,
                             &x_decode, &err),
          "sg_transfer_expect", &err);
    o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
    sg_error_info_init(&err);
    check(sg_transfer_post(at_prefill, "prompt", src_kv.h, table.data(), table.size(), uint64_t(n_tokens), &o,
                           &x_prefill, &err),
          "sg_transfer_post", &err);
    check(sg_transfer_wait(x_decode, 30'000'000'000ull), "sg_transfer_wait (decode)");
    check(sg_transfer_wait(x_prefill, 30'000'000'000ull), "sg_transfer_wait (prefill)");
    sg_transfer_stats_t st;
    sg_transfer_stats_init(&st);
    check(sg_transfer_stats(x_decode, &st), "sg_transfer_stats");
    if (st.quantized_bytes == 0) fail("the transfer moved nothing quantized (wire_quant " + std::to_string(wire_quant) + ")");
    sg_transfer_release(x_decode);
    sg_transfer_release(x_prefill);
    sg_session_close(at_prefill, 1'000'000'000ull);
    sg_session_close(at_decode, 1'000'000'000ull);
    sg_session_destroy(at_prefill);
    sg_session_destroy(at_decode);
    return {st.quantized_bytes, st.quantized_wire_bytes};
}

// Owners for the C handles, so that an exception part-way through frees them.
struct ProfileDeleter {
    void operator()(sg_profile_s* p) const { sg_profile_destroy(p); }
};
struct SelectorDeleter {
    void operator()(sg_selector_s* s) const { sg_selector_destroy(s); }
};
using ProfilePtr = std::unique_ptr<sg_profile_s, ProfileDeleter>;
using SelectorPtr = std::unique_ptr<sg_selector_s, SelectorDeleter>;

// One prompt, one block size: the prefilled pool and what every run over it shares. Decode runs never
// touch the prompt's K/V (they write positions >= n only, and a step reads positions <= its own), so
// all runs start from the same prefill.
class PromptRuns {
  public:
    PromptRuns(const Model& model, std::span<const int> prompt, int block_tokens, const QualityOptions& o)
        : model_(model),
          c_(model.config()),
          n_(int(prompt.size())),
          B_(block_tokens),
          N_(o.new_tokens),
          nb_(blocks_for(n_, B_)),
          storage_(c_, B_, blocks_for(c_.seq_len, B_)),
          pool_(storage_.view()),
          table_(identity_table(blocks_for(c_.seq_len, B_))),
          state_(c_) {
        PrefillOptions po;
        po.window = o.window;
        po.capture = &capture_;
        full_.push_back(argmax(prefill(model_, pool_, table_, prompt, state_, po)));
        // The full-attention reference, and the true attention of its first decode step.
        for (int i = 1; i < N_; ++i) {
            const auto logits = decode_step(model_, pool_, table_, n_ + i - 1, full_.back(), state_, nullptr,
                                            i == 1 ? &probe_ : nullptr);
            full_.push_back(argmax(logits));
        }
        // The selector reads the window queries as [row][head][head_size]; the capture holds
        // [layer][head][row][head_size].
        const int W = capture_.window, H = c_.n_heads, hs = c_.head_size();
        window_queries_.resize(size_t(c_.n_layers));
        for (int l = 0; l < c_.n_layers; ++l) {
            auto& q = window_queries_[size_t(l)];
            q.resize(size_t(W) * H * hs);
            for (int r = 0; r < W; ++r)
                for (int h = 0; h < H; ++h)
                    std::copy(capture_.query(l, h, r), capture_.query(l, h, r) + hs,
                              q.begin() + (size_t(r) * H + h) * hs);
        }
        layout_ = layout_of(pool_);
        if (o.wire_quant) {
            received_.emplace(c_, B_, blocks_for(c_.seq_len, B_));
            wire_bytes_ = deliver(pool_, received_->view(), n_, B_, o.wire_quant);
        }
    }

    // With wire_quant: the pool bytes the prompt's delivery moved and the bytes it took on the wire.
    std::pair<uint64_t, uint64_t> wire_bytes() const { return wire_bytes_; }

    PromptQuality measure(double budget, const QualityOptions& o) {
        // Two profiles of the same budget, as smartgen-disagg builds them from --budget: P's (the
        // prefill side's: o.proactive_policy, sinks and recent one block each) and S_t's (the decode
        // side's: quest on the digests, no sinks or recent window, which P already holds).
        auto make = [&](const std::string& policy, bool sinks_and_recent, ProfilePtr& profile_owner,
                        SelectorPtr& selector_owner) {
            const std::string json =
                budget_profile(o.model_name, c_.n_layers, c_.n_kv_heads, B_, budget, policy, sinks_and_recent);
            sg_error_info_t err;
            sg_error_info_init(&err);
            sg_profile_t profile = nullptr;
            check(sg_profile_parse(json.data(), json.size(), &profile, &err), "sg_profile_parse", &err);
            profile_owner.reset(profile);
            sg_selector_t selector = nullptr;
            sg_error_info_init(&err);
            check(sg_selector_create(profile, &layout_, uint64_t(n_), &selector, &err), "sg_selector_create", &err);
            selector_owner.reset(selector);
            return selector;
        };
        ProfilePtr decode_profile, proactive_profile;
        SelectorPtr decode_selector, proactive_selector;
        sel_ = make("quest", false, decode_profile, decode_selector);
        const sg_selector_t proactive = make(o.proactive_policy, true, proactive_profile, proactive_selector);

        size_t floats = 0;
        check(sg_selector_digest_floats(sel_, &floats), "sg_selector_digest_floats");
        digests_.assign(size_t(c_.n_layers), std::vector<float>(floats));
        P_.assign(size_t(c_.n_layers), {});
        picked_.resize(nb_);
        for (int l = 0; l < c_.n_layers; ++l) {
            check(
                sg_selector_digest(sel_, &layout_, uint32_t(l), table_.data(), nb_, digests_[size_t(l)].data(), floats),
                "sg_selector_digest");
            sg_selector_input_t in;
            sg_selector_input_init(&in);
            in.queries = window_queries_[size_t(l)].data();
            in.num_queries = uint32_t(capture_.window);
            in.num_q_heads = uint32_t(c_.n_heads);
            in.digests = digests_[size_t(l)].data();
            in.keys_layout = &layout_;
            in.block_ids = table_.data();
            in.num_block_ids = nb_;
            size_t count = 0;
            check(sg_selector_select(proactive, uint32_t(l), &in, picked_.data(), picked_.size(), &count),
                  "sg_selector_select (proactive)");
            P_[size_t(l)].assign(picked_.begin(), picked_.begin() + ptrdiff_t(count));
        }

        PromptQuality q;
        q.prompt_tokens = n_;
        proactive_recall(q);
        for (const bool on_demand : {true, false}) {
            SetScores& s = on_demand ? q.with_on_demand : q.proactive_only;
            const RunScores forced = run(on_demand, false, true);
            s.teacher_forced = forced.agreement;
            s.attended = forced.attended;
            s.mass_recall = forced.mass_recall;
            s.mass_recall_oracle = forced.mass_recall_oracle;
            s.teacher_forced_oracle = run(on_demand, true, true).agreement;
            s.free_running = run(on_demand, false, false).agreement;
            s.free_running_oracle = run(on_demand, true, false).agreement;
        }
        sel_ = nullptr;
        return q;
    }

  private:
    // Recall of P and of the oracle's |P_l| blocks, from full attention's first decode step.
    void proactive_recall(PromptQuality& q) {
        const int L = c_.n_layers, H = c_.n_heads;
        std::vector<double> mass(nb_), summed(nb_);
        double recall = 0.0, oracle = 0.0, proactive = 0.0;
        for (int l = 0; l < L; ++l) {
            std::fill(summed.begin(), summed.end(), 0.0);
            for (int h = 0; h < H; ++h) {
                const float* p = probe_.row(l, h);
                for (int u = 0; u < n_; ++u) summed[size_t(u / B_)] += double(p[u]);
            }
            const auto& P = P_[size_t(l)];
            const auto best = top_blocks(summed, P.size());
            for (int h = 0; h < H; ++h) {
                std::fill(mass.begin(), mass.end(), 0.0);
                const float* p = probe_.row(l, h);
                for (int u = 0; u < n_; ++u) mass[size_t(u / B_)] += double(p[u]);
                const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
                double in_p = 0.0, in_best = 0.0;
                for (uint32_t b : P) in_p += mass[b];
                for (uint32_t b : best) in_best += mass[b];
                recall += total > 0.0 ? in_p / total : 1.0;
                oracle += total > 0.0 ? in_best / total : 1.0;
            }
            proactive += double(P.size()) / double(nb_);
        }
        q.recall = recall / double(L * H);
        q.recall_oracle = oracle / double(L * H);
        q.proactive = proactive / double(L);
    }

    struct RunScores {
        double agreement = 0.0, attended = 0.0;
        double mass_recall = 0.0, mass_recall_oracle = 0.0;  // not measured for the oracle's own runs
    };

    // Steps 2..N with one kind of set. Agreement, teacher-forced: the fraction of steps whose argmax is
    // the full-attention token; free-running: the common prefix with the full-attention tokens over N - 1.
    RunScores run(bool on_demand, bool oracle, bool teacher_forced) {
        uint64_t attended_blocks = 0, layer_steps = 0;
        double recall_sum = 0.0, oracle_recall_sum = 0.0;
        AttendSet as;
        as.prompt_len = n_;
        as.select = [&](int l, const float* q) -> const std::vector<uint32_t>* {
            const auto& P = P_[size_t(l)];
            if (on_demand) {
                sg_selector_input_t in;
                sg_selector_input_init(&in);
                in.queries = q;
                in.num_queries = 1;
                in.num_q_heads = uint32_t(c_.n_heads);
                in.digests = digests_[size_t(l)].data();
                size_t count = 0;
                check(sg_selector_select(sel_, uint32_t(l), &in, picked_.data(), picked_.size(), &count),
                      "sg_selector_select (decode step)");
                set_.clear();
                std::set_union(P.begin(), P.end(), picked_.begin(), picked_.begin() + ptrdiff_t(count),
                               std::back_inserter(set_));
            } else {
                set_ = P;
            }
            if (oracle) {
                set_ = top_blocks(true_block_mass(l, q), set_.size());
            } else {
                const auto& mass = true_block_mass(l, q);
                const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
                double in_set = 0.0, in_best = 0.0;
                for (uint32_t b : set_) in_set += mass[b];
                for (uint32_t b : top_blocks(mass, set_.size())) in_best += mass[b];
                recall_sum += total > 0.0 ? in_set / total : 1.0;
                oracle_recall_sum += total > 0.0 ? in_best / total : 1.0;
            }
            attended_blocks += set_.size();
            layer_steps += 1;
            return &set_;
        };
        int next = full_[0], agreed = 0;
        for (int i = 1; i < N_; ++i) {
            const int input = teacher_forced ? full_[size_t(i - 1)] : next;
            pos_ = n_ + i - 1;
            next = argmax(decode_step(model_, attended(), table_, pos_, input, state_, &as));
            if (next == full_[size_t(i)])
                ++agreed;
            else if (!teacher_forced)
                break;
        }
        RunScores r;
        r.agreement = double(agreed) / double(N_ - 1);
        r.attended = double(attended_blocks) / double(layer_steps) / double(nb_);
        r.mass_recall = recall_sum / double(layer_steps);
        r.mass_recall_oracle = oracle_recall_sum / double(layer_steps);
        return r;
    }

    // The true attention of this step's query of layer l (positions 0..pos, whose K the pool holds),
    // summed over the query heads, per prompt block.
    const std::vector<double>& true_block_mass(int l, const float* q) {
        const int pos = pos_;
        const int G = c_.n_kv_heads, hs = c_.head_size(), mul = c_.kv_mul();
        keys_.resize(size_t(G) * size_t(pos + 1) * size_t(hs));
        for (int g = 0; g < G; ++g)
            for (int u = 0; u <= pos; ++u)
                read_kv(attended(), table_, l, false, u, g, keys_.data() + (size_t(g) * size_t(pos + 1) + size_t(u)) * hs);
        block_mass_.assign(nb_, 0.0);
        scores_.resize(size_t(pos) + 1);
        const double scale = 1.0 / std::sqrt(double(hs));
        for (int h = 0; h < c_.n_heads; ++h) {
            const float* qh = q + size_t(h) * hs;
            const float* kg = keys_.data() + size_t(h / mul) * size_t(pos + 1) * hs;
            double mx = -INFINITY;
            for (int u = 0; u <= pos; ++u) {
                double s = 0.0;
                for (int i = 0; i < hs; ++i) s += double(qh[i]) * double(kg[size_t(u) * hs + i]);
                scores_[size_t(u)] = s * scale;
                mx = std::max(mx, scores_[size_t(u)]);
            }
            double z = 0.0;
            for (double& s : scores_) z += (s = std::exp(s - mx));
            for (int u = 0; u < n_; ++u) block_mass_[size_t(u / B_)] += scores_[size_t(u)] / z;
        }
        return block_mass_;
    }

    const Model& model_;
    const Config& c_;
    const int n_, B_, N_;
    const uint32_t nb_;
    // The pool sparse decode attends to (and the oracle's true attention reads): the prefill's own,
    // or what a quantized transfer delivered into received_.
    const KvPool& attended() const { return received_ ? received_->view() : pool_; }

    KvPoolStorage storage_;
    const KvPool& pool_;
    std::optional<KvPoolStorage> received_;
    std::pair<uint64_t, uint64_t> wire_bytes_{};  // the delivery's (pool bytes, wire bytes)
    std::vector<uint32_t> table_;
    RunState state_;
    PrefillCapture capture_;
    AttentionProbe probe_;
    std::vector<int> full_;
    std::vector<std::vector<float>> window_queries_;
    sg_kv_layout_t layout_{};

    sg_selector_t sel_ = nullptr;  // during measure()
    int pos_ = 0;                  // position of the decode step in progress (the select callback is not told it)
    std::vector<std::vector<float>> digests_;
    std::vector<std::vector<uint32_t>> P_;
    std::vector<uint32_t> picked_, set_;
    std::vector<float> keys_;
    std::vector<double> scores_, block_mass_;
};

// Means over prompts, field by field.
PromptQuality mean_of(const std::vector<PromptQuality>& v) {
    PromptQuality m;
    auto add = [](SetScores& a, const SetScores& b) {
        a.attended += b.attended;
        a.teacher_forced += b.teacher_forced;
        a.teacher_forced_oracle += b.teacher_forced_oracle;
        a.free_running += b.free_running;
        a.free_running_oracle += b.free_running_oracle;
        a.mass_recall += b.mass_recall;
        a.mass_recall_oracle += b.mass_recall_oracle;
    };
    auto scale = [](SetScores& a, double k) {
        a.attended *= k;
        a.teacher_forced *= k;
        a.teacher_forced_oracle *= k;
        a.free_running *= k;
        a.free_running_oracle *= k;
        a.mass_recall *= k;
        a.mass_recall_oracle *= k;
    };
    long tokens = 0;
    for (const auto& p : v) {
        tokens += p.prompt_tokens;
        m.proactive += p.proactive;
        m.recall += p.recall;
        m.recall_oracle += p.recall_oracle;
        add(m.with_on_demand, p.with_on_demand);
        add(m.proactive_only, p.proactive_only);
    }
    const double k = v.empty() ? 0.0 : 1.0 / double(v.size());
    m.prompt_tokens = v.empty() ? 0 : int(tokens / long(v.size()));
    m.proactive *= k;
    m.recall *= k;
    m.recall_oracle *= k;
    scale(m.with_on_demand, k);
    scale(m.proactive_only, k);
    return m;
}

std::string budget_label(double f) {
    if (f == 1.0) return "1";
    const double inv = 1.0 / f;
    if (std::fabs(inv - std::round(inv)) < 1e-9) return "1/" + std::to_string(long(std::round(inv)));
    return format("%.4g", f);
}

std::string ratio(double a, double b) { return b > 0.0 ? format("%.3f", a / b) : "—"; }
std::string num(double x) { return format("%.3f", x); }

struct Table {
    std::vector<std::string> header;
    std::vector<std::vector<std::string>> rows;

    std::string markdown() const {
        std::ostringstream os;
        auto line = [&](const std::vector<std::string>& cells) {
            os << "|";
            for (const auto& c : cells) os << " " << c << " |";
            os << "\n";
        };
        line(header);
        line(std::vector<std::string>(header.size(), "---"));
        for (const auto& r : rows) line(r);
        return os.str();
    }
    std::string text() const {
        // Width in characters, not bytes: the set names hold multi-byte symbols.
        auto width = [](const std::string& s) {
            size_t w = 0;
            for (unsigned char ch : s) w += (ch & 0xC0) != 0x80;
            return w;
        };
        std::vector<size_t> w(header.size());
        for (size_t i = 0; i < header.size(); ++i) w[i] = width(header[i]);
        for (const auto& r : rows)
            for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], width(r[i]));
        std::ostringstream os;
        auto line = [&](const std::vector<std::string>& cells) {
            for (size_t i = 0; i < cells.size(); ++i)
                os << cells[i] << std::string(w[i] - width(cells[i]) + (i + 1 < cells.size() ? 2 : 0), ' ');
            os << "\n";
        };
        line(header);
        for (const auto& r : rows) line(r);
        return os.str();
    }
};

Table agreement_table(const QualityReport& r) {
    Table t;
    t.header = {"block", "budget",       "set",    "attended", "teacher-forced", "oracle",
                "ratio", "free-running", "oracle", "ratio",    "mass recall",    "oracle"};
    for (const auto& c : r.cells)
        for (const bool on_demand : {true, false}) {
            const SetScores& s = on_demand ? c.mean.with_on_demand : c.mean.proactive_only;
            t.rows.push_back({std::to_string(c.block_tokens), budget_label(c.budget),
                              on_demand ? "P ∪ S_t ∪ G" : "P ∪ G (proactive only)", num(s.attended),
                              num(s.teacher_forced), num(s.teacher_forced_oracle),
                              ratio(s.teacher_forced, s.teacher_forced_oracle), num(s.free_running),
                              num(s.free_running_oracle), ratio(s.free_running, s.free_running_oracle),
                              num(s.mass_recall), num(s.mass_recall_oracle)});
        }
    return t;
}

Table recall_table(const QualityReport& r) {
    Table t;
    t.header = {"block", "budget", "P share", "recall of P", "oracle", "ratio"};
    for (const auto& c : r.cells)
        t.rows.push_back({std::to_string(c.block_tokens), budget_label(c.budget), num(c.mean.proactive),
                          num(c.mean.recall), num(c.mean.recall_oracle), ratio(c.mean.recall, c.mean.recall_oracle)});
    return t;
}

std::string lengths(const std::vector<int>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s;
}

}  // namespace

std::vector<uint32_t> top_blocks(std::span<const double> mass, size_t k) {
    std::vector<uint32_t> idx(mass.size());
    std::iota(idx.begin(), idx.end(), 0u);
    k = std::min(k, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + ptrdiff_t(k), idx.end(),
                      [&](uint32_t a, uint32_t b) { return mass[a] > mass[b] || (mass[a] == mass[b] && a < b); });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    return idx;
}

std::string budget_profile(const std::string& model, int layers, int kv_heads, int block_tokens, double fraction,
                           const std::string& policy, bool sinks_and_recent) {
    const int edge = sinks_and_recent ? block_tokens : 0;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "{\"version\": 1, \"model\": \"%s\", \"num_layers\": %d, \"num_kv_heads\": %d, \"block_tokens\": %d, "
                  "\"defaults\": {\"policy\": \"%s\", \"budget\": {\"fraction\": %.17g}, \"sinks\": %d, "
                  "\"recent\": %d}}",
                  model.c_str(), layers, kv_heads, block_tokens, policy.c_str(), fraction, edge, edge);
    return buf;
}

QualityReport measure_quality(const Model& model, std::span<const std::vector<int>> prompts,
                              const QualityOptions& options) {
    const Config& c = model.config();
    const auto t0 = std::chrono::steady_clock::now();
    if (options.new_tokens < 2) fail("new_tokens must be >= 2 (token 1 comes from prefill, the rest are sparse)");
    if (options.window < 1) fail("window must be >= 1");
    if (options.proactive_policy != "quest" && options.proactive_policy != "snapkv")
        fail("proactive_policy must be quest or snapkv, got '" + options.proactive_policy + "'");
    if (options.block_tokens.empty() || options.budgets.empty()) fail("no block size or no budget");
    for (int B : options.block_tokens)
        if (B < 1) fail("block sizes must be >= 1");
    for (double f : options.budgets)
        if (!(f > 0.0 && f <= 1.0)) fail("budgets must be fractions in (0, 1]");

    QualityReport r;
    r.model = options.model_name;
    r.shape = c;
    r.new_tokens = options.new_tokens;
    r.window = options.window;
    r.wire_quant = options.wire_quant;
    std::vector<std::span<const int>> used;
    for (const auto& p : prompts) {
        for (int t : p)
            if (t < 0 || t >= c.vocab_size) fail("token id " + std::to_string(t) + " is outside the vocabulary");
        // Positions 0 .. n + N - 2 are run (the last token is predicted, not fed).
        if (!p.empty() && int(p.size()) + options.new_tokens - 1 <= c.seq_len) {
            used.emplace_back(p);
            r.prompt_tokens.push_back(int(p.size()));
        } else {
            r.skipped_prompt_tokens.push_back(int(p.size()));
        }
    }
    if (used.empty()) fail("no prompt leaves room for " + std::to_string(options.new_tokens) + " new tokens");

    for (int B : options.block_tokens) {
        const size_t first = r.cells.size();
        for (double f : options.budgets) r.cells.push_back(QualityCell{B, f, {}, {}});
        for (size_t i = 0; i < used.size(); ++i) {
            PromptRuns runs(model, used[i], B, options);
            r.quantized_bytes += runs.wire_bytes().first;
            r.quantized_wire_bytes += runs.wire_bytes().second;
            for (size_t j = 0; j < options.budgets.size(); ++j)
                r.cells[first + j].prompts.push_back(runs.measure(options.budgets[j], options));
            if (options.progress)
                options.progress("block " + std::to_string(B) + ": prompt " + std::to_string(i + 1) + "/" +
                                 std::to_string(used.size()) + " (" + std::to_string(used[i].size()) + " tokens) done");
        }
    }
    for (auto& cell : r.cells) cell.mean = mean_of(cell.prompts);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

std::string QualityReport::to_json() const {
    using ojson = nlohmann::ordered_json;
    auto set_json = [](const SetScores& s) {
        return ojson{{"attended", s.attended},
                     {"teacher_forced", s.teacher_forced},
                     {"teacher_forced_oracle", s.teacher_forced_oracle},
                     {"free_running", s.free_running},
                     {"free_running_oracle", s.free_running_oracle},
                     {"mass_recall", s.mass_recall},
                     {"mass_recall_oracle", s.mass_recall_oracle}};
    };
    auto prompt_json = [&](const PromptQuality& p) {
        return ojson{{"prompt_tokens", p.prompt_tokens},
                     {"proactive", p.proactive},
                     {"recall", p.recall},
                     {"recall_oracle", p.recall_oracle},
                     {"with_on_demand", set_json(p.with_on_demand)},
                     {"proactive_only", set_json(p.proactive_only)}};
    };
    ojson j;
    j["schema"] = "smartgen-selection-quality";
    j["version"] = 1;
    j["model"] = model;
    j["shape"] = ojson{{"num_layers", shape.n_layers},
                       {"num_heads", shape.n_heads},
                       {"num_kv_heads", shape.n_kv_heads},
                       {"head_dim", shape.head_size()},
                       {"seq_len", shape.seq_len}};
    j["new_tokens"] = new_tokens;
    j["window"] = window;
    j["wire_quant"] = wire_quant_name(wire_quant);
    j["quantized_bytes"] = quantized_bytes;
    j["quantized_wire_bytes"] = quantized_wire_bytes;
    j["prompt_tokens"] = prompt_tokens;
    j["skipped_prompt_tokens"] = skipped_prompt_tokens;
    j["seconds"] = seconds;
    ojson cj = ojson::array();
    for (const auto& cell : cells) {
        ojson per = ojson::array();
        for (const auto& p : cell.prompts) per.push_back(prompt_json(p));
        ojson m = prompt_json(cell.mean);
        m.erase("prompt_tokens");
        cj.push_back(ojson{{"block_tokens", cell.block_tokens},
                           {"budget", cell.budget},
                           {"mean", std::move(m)},
                           {"prompts", std::move(per)}});
    }
    j["cells"] = std::move(cj);
    return j.dump(2) + "\n";
}

std::string QualityReport::to_markdown() const {
    std::ostringstream os;
    os << "Agreement with full attention (means over " << prompt_tokens.size() << " prompts; " << new_tokens - 1
       << " sparse steps each):\n\n"
       << agreement_table(*this).markdown() << "\nProactive set P at the first decode step:\n\n"
       << recall_table(*this).markdown();
    if (wire_quant)
        os << "\nIn-flight quantization " << (wire_quant == SG_WIRE_QUANT_INT8 ? "int8" : "fp8 E4M3") << ": the prompts' KV took "
           << quantized_wire_bytes << " bytes on the wire for " << quantized_bytes << " pool bytes ("
           << format("%.3f", quantized_bytes ? double(quantized_wire_bytes) / double(quantized_bytes) : 0.0)
           << " of them).\n";
    return os.str();
}

std::string QualityReport::to_text() const {
    std::ostringstream os;
    os << model << ": " << prompt_tokens.size() << " prompts (" << lengths(prompt_tokens) << " tokens), " << new_tokens
       << " new tokens, window " << window << "\n";
    if (!skipped_prompt_tokens.empty())
        os << "left out: prompts of " << lengths(skipped_prompt_tokens) << " tokens (no room for " << new_tokens
           << " new tokens in the " << shape.seq_len << "-position context)\n";
    os << "\nagreement with full attention (means over prompts)\n" << agreement_table(*this).text();
    os << "\nproactive set P at the first decode step\n" << recall_table(*this).text();
    os << "\n" << format("%.1f", seconds) << " s\n";
    return os.str();
}

}  // namespace sg::disagg
