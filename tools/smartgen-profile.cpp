// smartgen-profile: makes a selection profile (docs/profiles.md, version 1) from attention statistics
// (the stats JSON of examples/disagg/calibrate.hpp, written by smartgen-calibrate --emit-stats).
//
// For each (layer, KV head) it reads the head's recall curve (the attention mass an oracle keeps with
// the best blocks, at each budget fraction) and takes the smallest budget whose recall reaches
// --target-recall. A head that needs more than --dense-above of its blocks is diffuse: it is marked
// dense (sent whole). Every other head gets --policy (quest or snapkv) with that budget, a fraction of
// the request. The curves were measured as the selector spends a budget, its sinks and recent window
// inside it (calibrate.hpp), so the profile takes sinks and recent from the stats: --sinks and
// --recent, when given, must equal them (recalibrate for other values). The budgets are what an
// oracle scorer needs; Quest and SnapKV approximate it, so their recall at the same budget is lower.
//
// It prints a table per layer and head and THE PROACTIVE BYTE FRACTION: at a request of --tokens N,
// the share of the request's KV (all layers, all KV heads) that the profile sends proactively,
// counted as the selector does (runtime/select): per head, dense = all ceil(N/B) blocks, else
// min(max(budget blocks, sink + recent blocks), all), summed over layers and heads and divided by
// layers * heads * ceil(N/B). A profile that marks everything dense prints 1.000000; nothing hides
// it. It also prints an upper bound for whole-block transfers, which move the union of a layer's
// per-head sets with every KV head.
//
// The profile is checked by the library before it is written: through sg_profile_parse from the
// public header when the libsmartgen it runs with exports it (the symbol is bound weakly, so this
// tool also runs with a library that predates it, and says so; --require-validation makes that an
// error).
//
// Usage: smartgen-profile --stats FILE [--out FILE] [--target-recall R] [--dense-above F]
//                         [--policy quest|snapkv] [--sinks T] [--recent T] [--tokens N]
//                         [--curve mean|p10] [--pool P] [--model NAME] [--max-fraction F]
//                         [--require-validation]
// Defaults: --target-recall 0.9, --dense-above 0.5, --policy quest, --sinks and --recent from the
// stats, --tokens the stats' mean prompt length, --curve mean, --pool 1. Without --out the profile goes
// to stdout and the report to stderr; with it, the report goes to stdout.
// Exit status: 0 done; 1 bad input or the library refused the profile; 2 usage; 3 the byte fraction
// exceeds --max-fraction (the profile is still written); 4 --require-validation and no validator.
#include <smartgen/smartgen.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// Bound weakly: a libsmartgen without the profile API leaves these null instead of failing to load.
extern "C" {
__attribute__((weak)) sg_status_t sg_profile_parse(const char *json, size_t len, sg_profile_t *out,
                                                   sg_error_info_t *err);
__attribute__((weak)) sg_status_t sg_profile_destroy(sg_profile_t profile);
}

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

[[noreturn]] void usage(const std::string &msg) {
    std::fprintf(stderr,
                 "smartgen-profile: %s\n"
                 "usage: smartgen-profile --stats FILE [--out FILE] [--target-recall R] [--dense-above F]\n"
                 "                        [--policy quest|snapkv] [--sinks T] [--recent T] [--tokens N]\n"
                 "                        [--curve mean|p10] [--pool P] [--model NAME] [--max-fraction F]\n"
                 "                        [--require-validation]\n",
                 msg.c_str());
    std::exit(2);
}

double parse_double(const std::string &flag, const char *v) {
    char *end = nullptr;
    const double x = std::strtod(v, &end);
    if (!*v || *end || !std::isfinite(x)) usage(flag + " takes a number, got '" + v + "'");
    return x;
}

long long parse_count(const std::string &flag, const char *v) {
    char *end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    if (!*v || *end || x < 0) usage(flag + " takes a non-negative integer, got '" + v + "'");
    return x;
}

struct Options {
    std::string stats_path, out_path, policy = "quest", curve = "mean", model;
    double target = 0.9, dense_above = 0.5, max_fraction = -1.0;
    long long sinks = -1, recent = -1, tokens = -1, pool = 1;
    bool require_validation = false;
};

struct HeadIn {
    std::vector<double> recall_mean, recall_p10;
    double entropy = 0.0;
    bool seen = false;
};

struct Stats {
    std::string model;
    uint32_t num_layers = 0, num_kv_heads = 0, block_tokens = 0;
    double mean_prompt_tokens = 0.0;
    uint64_t sinks = 0, recent = 0;
    std::vector<double> budgets;
    std::vector<HeadIn> heads;  // [layer][kv_head]
};

const json &field(const json &j, const char *key, const std::string &where) {
    if (!j.is_object() || !j.contains(key)) throw Error("stats: " + where + key + ": missing");
    return j.at(key);
}

uint32_t positive(const json &j, const char *key, const std::string &where) {
    const json &v = field(j, key, where);
    if (!v.is_number_integer() || v.get<long long>() < 1 || v.get<long long>() > (1ll << 31))
        throw Error("stats: " + where + key + ": must be an integer >= 1");
    return uint32_t(v.get<long long>());
}

std::vector<double> curve(const json &j, const char *key, const std::string &where, size_t n) {
    const json &v = field(j, key, where);
    if (!v.is_array() || v.size() != n)
        throw Error("stats: " + where + key + ": must be an array of " + std::to_string(n) + " numbers");
    std::vector<double> c;
    for (const json &x : v) {
        if (!x.is_number()) throw Error("stats: " + where + key + ": must hold numbers");
        c.push_back(x.get<double>());
        if (!(c.back() >= 0.0 && c.back() <= 1.0)) throw Error("stats: " + where + key + ": recall outside [0, 1]");
        if (c.size() > 1 && c.back() < c[c.size() - 2])
            throw Error("stats: " + where + key + ": recall decreases with the budget");
    }
    if (c.back() != 1.0) throw Error("stats: " + where + key + ": recall at budget 1 must be 1");
    return c;
}

Stats read_stats(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("cannot read " + path);
    json j;
    try {
        in >> j;
    } catch (const std::exception &e) {
        throw Error(path + ": " + e.what());
    }
    if (!j.is_object() || j.value("schema", "") != "smartgen-calibration-stats")
        throw Error("stats: schema: not a smartgen-calibration-stats file");
    if (j.value("version", 0) != 1) throw Error("stats: version: only version 1 is understood");
    Stats s;
    const json &model = field(j, "model", "");
    if (!model.is_string() || model.get<std::string>().empty()) throw Error("stats: model: must be a non-empty string");
    s.model = model.get<std::string>();
    const json &shape = field(j, "shape", "");
    s.num_layers = positive(shape, "num_layers", "shape.");
    s.num_kv_heads = positive(shape, "num_kv_heads", "shape.");
    s.block_tokens = positive(j, "block_tokens", "");
    const json &pt = field(j, "prompt_tokens", "");
    const json &mean = field(pt, "mean", "prompt_tokens.");
    if (!mean.is_number() || mean.get<double>() < 1.0) throw Error("stats: prompt_tokens.mean: must be >= 1");
    s.mean_prompt_tokens = mean.get<double>();
    for (const char *key : {"sinks", "recent"}) {
        const json &v = field(j, key, "");
        if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() > UINT32_MAX)
            throw Error(std::string("stats: ") + key + ": must be an integer >= 0");
        (key[0] == 's' ? s.sinks : s.recent) = uint64_t(v.get<long long>());
    }
    const json &b = field(j, "budgets", "");
    if (!b.is_array() || b.empty()) throw Error("stats: budgets: must be a non-empty array");
    for (const json &x : b) {
        if (!x.is_number()) throw Error("stats: budgets: must hold numbers");
        const double f = x.get<double>();
        if (!(f > 0.0 && f <= 1.0) || (!s.budgets.empty() && f <= s.budgets.back()))
            throw Error("stats: budgets: must be ascending fractions in (0, 1]");
        s.budgets.push_back(f);
    }
    if (s.budgets.back() != 1.0) throw Error("stats: budgets: the last must be 1");
    s.heads.resize(size_t(s.num_layers) * s.num_kv_heads);
    const json &heads = field(j, "heads", "");
    if (!heads.is_array()) throw Error("stats: heads: must be an array");
    for (size_t i = 0; i < heads.size(); ++i) {
        const std::string where = "heads[" + std::to_string(i) + "].";
        const json &h = heads[i];
        const json &l = field(h, "layer", where), &g = field(h, "kv_head", where);
        if (!l.is_number_integer() || !g.is_number_integer() || l.get<long long>() < 0 || g.get<long long>() < 0 ||
            l.get<long long>() >= s.num_layers || g.get<long long>() >= s.num_kv_heads)
            throw Error("stats: " + where + "layer/kv_head: outside the shape");
        HeadIn &hi = s.heads[size_t(l.get<long long>()) * s.num_kv_heads + size_t(g.get<long long>())];
        if (hi.seen) throw Error("stats: " + where + "layer/kv_head: given twice");
        hi.seen = true;
        hi.recall_mean = curve(h, "recall_mean", where, s.budgets.size());
        hi.recall_p10 = curve(h, "recall_p10", where, s.budgets.size());
        const json &e = field(h, "entropy", where);
        if (!e.is_number()) throw Error("stats: " + where + "entropy: must be a number");
        hi.entropy = e.get<double>();
    }
    for (size_t i = 0; i < s.heads.size(); ++i)
        if (!s.heads[i].seen)
            throw Error("stats: heads: layer " + std::to_string(i / s.num_kv_heads) + " KV head " +
                        std::to_string(i % s.num_kv_heads) + " is missing");
    return s;
}

// ---- the selector's block arithmetic (runtime/select/select.cpp) ---------------------------------

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

uint64_t fraction_of(double f, uint64_t n) {
    const double x = f * double(n);
    const double r = std::round(x);
    if (std::fabs(x - r) <= 1e-9 * std::max(1.0, x)) return uint64_t(r);
    return uint64_t(std::ceil(x));
}

struct Decision {
    double needed = 1.0;  // smallest budget fraction reaching the target (the oracle's)
    bool dense = false;
    double budget = 1.0;  // fraction, when not dense
    uint64_t blocks = 0;  // sent at the report's request length
};

// Sink and recent-window blocks of one head in a request of n tokens (Selector's constructor).
uint64_t forced_blocks(uint64_t n, uint64_t block_tokens, uint64_t sinks, uint64_t recent) {
    const uint64_t nb = ceil_div(n, block_tokens);
    const uint64_t sink_end = std::min(nb, ceil_div(sinks, block_tokens));
    uint64_t recent_from = nb;
    if (recent > 0) recent_from = recent >= n ? 0 : (n - recent) / block_tokens;
    recent_from = std::max(recent_from, sink_end);
    return sink_end + (nb - recent_from);
}

// Blocks one head sends in a request of n tokens (Selector's constructor and select_layer).
uint64_t head_blocks(const Decision &d, uint64_t n, uint64_t block_tokens, uint64_t sinks, uint64_t recent) {
    const uint64_t nb = ceil_div(n, block_tokens);
    if (d.dense) return nb;
    const uint64_t forced = forced_blocks(n, block_tokens, sinks, recent);
    const uint64_t own = std::min(nb, ceil_div(fraction_of(d.budget, n), block_tokens));
    return std::min(std::max(own, forced), nb);
}

double at(const Stats &s, const std::vector<double> &c, double f) {
    for (size_t i = 0; i < s.budgets.size(); ++i)
        if (s.budgets[i] >= f - 1e-12) return c[i];
    return 1.0;
}

// The most frequent non-dense budget (ties to the larger), the profile's default.
double default_budget(const std::vector<Decision> &ds) {
    std::map<double, int> count;
    for (const Decision &d : ds)
        if (!d.dense) count[d.budget]++;
    double best = 1.0;
    int n = 0;
    for (const auto &[f, c] : count)
        if (c >= n) best = f, n = c;
    return best;
}

ojson budget_json(double f) { return ojson{{"fraction", f}}; }

std::string make_profile(const Stats &s, const Options &o, const std::vector<Decision> &ds) {
    ojson p;
    p["version"] = 1;
    p["model"] = o.model.empty() ? s.model : o.model;
    p["num_layers"] = s.num_layers;
    p["num_kv_heads"] = s.num_kv_heads;
    p["block_tokens"] = s.block_tokens;
    p["combine"] = "sum";  // the statistics summed the query heads of a group
    if (o.pool > 1) p["pool"] = o.pool;
    const bool any_sparse = std::any_of(ds.begin(), ds.end(), [](const Decision &d) { return !d.dense; });
    const double def = default_budget(ds);
    ojson defaults;
    if (any_sparse) {
        defaults["policy"] = o.policy;
        defaults["budget"] = budget_json(def);
        defaults["sinks"] = o.sinks;
        defaults["recent"] = o.recent;
    } else {
        defaults["policy"] = "dense";
    }
    p["defaults"] = defaults;
    ojson layers = ojson::array();
    for (uint32_t l = 0; l < s.num_layers; ++l) {
        const Decision *row = &ds[size_t(l) * s.num_kv_heads];
        const bool all_dense = std::all_of(row, row + s.num_kv_heads, [](const Decision &d) { return d.dense; });
        if (all_dense && any_sparse) {
            layers.push_back(ojson{{"layer", l}, {"policy", "dense"}});
            continue;
        }
        ojson heads = ojson::array();
        for (uint32_t g = 0; g < s.num_kv_heads; ++g) {
            if (row[g].dense && any_sparse)
                heads.push_back(ojson{{"head", g}, {"policy", "dense"}});
            else if (!row[g].dense && row[g].budget != def)
                heads.push_back(ojson{{"head", g}, {"budget", budget_json(row[g].budget)}});
        }
        if (!heads.empty()) layers.push_back(ojson{{"layer", l}, {"heads", heads}});
    }
    if (!layers.empty()) p["layers"] = layers;
    // One field per line, one layer override per line.
    std::string out = "{\n";
    size_t i = 0;
    for (const auto &[key, value] : p.items()) {
        out += "  " + ojson(key).dump() + ": ";
        if (key == "layers") {
            out += "[\n";
            for (size_t k = 0; k < value.size(); ++k)
                out += "    " + value[k].dump() + (k + 1 < value.size() ? ",\n" : "\n");
            out += "  ]";
        } else {
            out += value.dump();
        }
        out += ++i < p.size() ? ",\n" : "\n";
    }
    return out + "}\n";
}

void say(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void say(FILE *f, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(f, fmt, ap);
    va_end(ap);
}

// 0 validated, 1 refused (message printed), 4 no validator in this libsmartgen.
int validate(const std::string &text, FILE *report) {
    if (!sg_profile_parse) {
        say(report, "validation: skipped: libsmartgen %s does not export sg_profile_parse\n", sg_version_string());
        return 4;
    }
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_profile_t prof = nullptr;
    const sg_status_t st = sg_profile_parse(text.data(), text.size(), &prof, &err);
    if (st != SG_OK) {
        std::fprintf(stderr, "smartgen-profile: libsmartgen refused the profile: %s: %s\n", sg_status_str(st),
                     err.message);
        return 1;
    }
    if (sg_profile_destroy) sg_profile_destroy(prof);
    say(report, "validation: accepted by sg_profile_parse (libsmartgen %s)\n", sg_version_string());
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") usage("makes a selection profile from calibration statistics");
        if (a == "--require-validation") {
            o.require_validation = true;
            continue;
        }
        if (i + 1 >= argc) usage(a + " needs a value");
        const char *v = argv[++i];
        if (a == "--stats")
            o.stats_path = v;
        else if (a == "--out")
            o.out_path = v;
        else if (a == "--policy")
            o.policy = v;
        else if (a == "--curve")
            o.curve = v;
        else if (a == "--model")
            o.model = v;
        else if (a == "--target-recall")
            o.target = parse_double(a, v);
        else if (a == "--dense-above")
            o.dense_above = parse_double(a, v);
        else if (a == "--max-fraction")
            o.max_fraction = parse_double(a, v);
        else if (a == "--sinks")
            o.sinks = parse_count(a, v);
        else if (a == "--recent")
            o.recent = parse_count(a, v);
        else if (a == "--tokens")
            o.tokens = parse_count(a, v);
        else if (a == "--pool")
            o.pool = parse_count(a, v);
        else
            usage("unknown option " + a);
    }
    if (o.stats_path.empty()) usage("--stats is required");
    if (o.policy != "quest" && o.policy != "snapkv") usage("--policy must be quest or snapkv");
    if (o.curve != "mean" && o.curve != "p10") usage("--curve must be mean or p10");
    if (!(o.target > 0.0 && o.target <= 1.0)) usage("--target-recall must be in (0, 1]");
    if (!(o.dense_above > 0.0 && o.dense_above <= 1.0)) usage("--dense-above must be in (0, 1]");
    if (o.pool < 1 || o.pool % 2 == 0) usage("--pool must be odd and >= 1");
    if (o.tokens == 0) usage("--tokens must be >= 1");
    if (o.sinks > UINT32_MAX || o.recent > UINT32_MAX) usage("--sinks and --recent must fit 32 bits");

    FILE *report = o.out_path.empty() ? stderr : stdout;
    try {
        const Stats s = read_stats(o.stats_path);
        const uint64_t B = s.block_tokens;
        if ((o.sinks >= 0 && uint64_t(o.sinks) != s.sinks) || (o.recent >= 0 && uint64_t(o.recent) != s.recent))
            throw Error("the stats were measured with sinks " + std::to_string(s.sinks) + " and recent " +
                        std::to_string(s.recent) +
                        " tokens, and their curves hold only for those: recalibrate (smartgen-calibrate --sinks "
                        "--recent) for other values");
        o.sinks = (long long)s.sinks;
        o.recent = (long long)s.recent;
        const uint64_t n = o.tokens > 0 ? uint64_t(o.tokens) : uint64_t(std::llround(s.mean_prompt_tokens));
        const uint64_t nb = ceil_div(n, B);

        std::vector<Decision> ds(s.heads.size());
        for (size_t i = 0; i < s.heads.size(); ++i) {
            const auto &c = o.curve == "mean" ? s.heads[i].recall_mean : s.heads[i].recall_p10;
            Decision &d = ds[i];
            for (size_t k = 0; k < s.budgets.size(); ++k)
                if (c[k] >= o.target - 1e-9) {
                    d.needed = s.budgets[k];
                    break;
                }
            d.dense = d.needed > o.dense_above;
            d.budget = d.dense ? 1.0 : d.needed;
            d.blocks = head_blocks(d, n, B, uint64_t(o.sinks), uint64_t(o.recent));
        }
        const std::string text = make_profile(s, o, ds);

        say(report, "profile for %s: %u layers x %u KV heads, blocks of %llu tokens\n", s.model.c_str(), s.num_layers,
            s.num_kv_heads, (unsigned long long)B);
        say(report, "target recall %.3f (%s curve), dense above %.3f, policy %s, sinks %lld, recent %lld tokens\n",
            o.target, o.curve.c_str(), o.dense_above, o.policy.c_str(), o.sinks, o.recent);
        say(report, "request of %llu tokens: %llu blocks per head\n\n", (unsigned long long)n, (unsigned long long)nb);
        say(report, "layer head  r@1/16  r@1/8  r@1/4  entropy  oracle  rule           blocks   sent\n");
        uint64_t sent = 0, union_bound = 0, dense = 0;
        for (uint32_t l = 0; l < s.num_layers; ++l) {
            uint64_t layer_sent = 0;
            for (uint32_t g = 0; g < s.num_kv_heads; ++g) {
                const size_t i = size_t(l) * s.num_kv_heads + g;
                const Decision &d = ds[i];
                const auto &c = o.curve == "mean" ? s.heads[i].recall_mean : s.heads[i].recall_p10;
                char rule[32];
                if (d.dense)
                    std::snprintf(rule, sizeof rule, "dense");
                else
                    std::snprintf(rule, sizeof rule, "%s %.4f", o.policy.c_str(), d.budget);
                say(report, "%5u %4u  %6.3f %6.3f %6.3f  %7.3f  %6.4f  %-13s %4llu/%-4llu %6.3f\n", l, g,
                    at(s, c, 1.0 / 16), at(s, c, 1.0 / 8), at(s, c, 1.0 / 4), s.heads[i].entropy, d.needed, rule,
                    (unsigned long long)d.blocks, (unsigned long long)nb, double(d.blocks) / double(nb));
                layer_sent += d.blocks;
                dense += d.dense;
            }
            sent += layer_sent;
            union_bound += std::min<uint64_t>(nb, layer_sent) * s.num_kv_heads;
        }
        const uint64_t all = uint64_t(s.num_layers) * s.num_kv_heads * nb;
        const double fraction = double(sent) / double(all);
        say(report, "\ndense heads: %llu of %zu\n", (unsigned long long)dense, ds.size());
        say(report, "proactive byte fraction: %.6f (%llu of %llu head-blocks at %llu tokens)\n", fraction,
            (unsigned long long)sent, (unsigned long long)all, (unsigned long long)n);
        say(report, "whole-block transfer (union over a layer's KV heads): at most %.6f\n",
            double(union_bound) / double(all));

        const int v = validate(text, report);
        if (v == 1) return 1;
        if (v == 4 && o.require_validation) {
            std::fprintf(stderr, "smartgen-profile: --require-validation: no sg_profile_parse to validate with\n");
            return 4;
        }
        if (o.out_path.empty()) {
            std::cout << text;
        } else {
            std::ofstream f(o.out_path, std::ios::binary);
            f << text;
            if (!f.flush()) throw Error("cannot write " + o.out_path);
        }
        if (o.max_fraction >= 0.0 && fraction > o.max_fraction) {
            std::fprintf(stderr, "smartgen-profile: byte fraction %.6f exceeds --max-fraction %.6f\n", fraction,
                         o.max_fraction);
            return 3;
        }
    } catch (const std::exception &e) {
        std::fprintf(stderr, "smartgen-profile: %s\n", e.what());
        return 1;
    }
    return 0;
}
