// Tests of examples/disagg/calibrate (attention statistics), of tools/smartgen-profile (statistics ->
// selection profile) and of the data shipped in examples/disagg/data.
//
// Checkpoints come from $SMARTGEN_MODEL_DIR, else the repository's examples/models (model_files.hpp);
// tests that need one are skipped, with the reason, when it is missing (a failure under
// SMARTGEN_REQUIRE_DATA=1). The tool tests run the built
// smartgen-profile (SMARTGEN_PROFILE_TOOL) and are skipped when tools are not built.
#include "calibrate.hpp"
#include "model_files.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using nlohmann::json;
using namespace sg::disagg;

namespace {

std::string model_path(const char* name) { return model_files::path(name); }
std::string data_path(const char* name) { return (fs::path(SMARTGEN_DISAGG_DATA_DIR) / name).string(); }

#define LOAD_MODEL_OR_SKIP(var, name)    \
    SG_NEED_DATA_FILE(model_path(name)); \
    const Model var = Model::load(model_path(name))

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
}

// A scratch directory per test, removed afterwards.
class TempDir {
  public:
    TempDir() {
        const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
        path_ = fs::temp_directory_path() /
                ("sg-calibrate-" + std::to_string(::getpid()) + "-" + info->test_suite_name() + "-" + info->name());
        fs::remove_all(path_);
        fs::create_directories(path_);
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    std::string operator/(const std::string& name) const { return (path_ / name).string(); }

  private:
    fs::path path_;
};

struct RunResult {
    int status = -1;
    std::string out;
};

// Runs a command with stdout and stderr into a file; returns the exit status and the output.
RunResult run(const std::string& cmd, const std::string& out_file) {
    const int rc = std::system((cmd + " >" + out_file + " 2>&1").c_str());
    RunResult r;
    r.status = rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    r.out = read_file(out_file);
    return r;
}

void expect_curve(const std::vector<double>& c, size_t n, const std::string& what) {
    ASSERT_EQ(c.size(), n) << what;
    for (size_t i = 0; i < n; ++i) {
        EXPECT_GE(c[i], 0.0) << what << " [" << i << "]";
        EXPECT_LE(c[i], 1.0) << what << " [" << i << "]";
        if (i) {
            EXPECT_GE(c[i], c[i - 1]) << what << " decreases at [" << i << "]";
        }
    }
    EXPECT_EQ(c.back(), 1.0) << what << " must end at exactly 1";
}

double at_budget(const CalibrationStats& st, const HeadCalibration& h, double f) {
    for (size_t i = 0; i < st.budgets.size(); ++i)
        if (st.budgets[i] >= f - 1e-12) return h.recall_mean[i];
    return 1.0;
}

// ---- calibration ------------------------------------------------------------------------------------

TEST(Calibrate, BudgetBlocksRoundAsTheSelectorDoes) {
    EXPECT_EQ(calibration_budget_blocks(0.25, 64, 16), 1u);
    EXPECT_EQ(calibration_budget_blocks(1.0 / 64, 1329, 16), 2u);  // 21 tokens -> 2 blocks
    EXPECT_EQ(calibration_budget_blocks(1.0, 541, 16), 34u);       // capped at the request
    EXPECT_EQ(calibration_budget_blocks(0.5, 8, 16), 1u);
    EXPECT_EQ(calibration_budget_blocks(0.3, 10, 1), 3u);  // 0.3 * 10 is 3, not 4 after rounding noise
}

TEST(Calibrate, StatsOnTwoPromptsAreWellFormed) {
    LOAD_MODEL_OR_SKIP(model, "stories260K.bin");
    auto prompts = load_prompts(data_path("prompts-tinystories.json"));
    ASSERT_GE(prompts.size(), 2u);
    prompts.resize(2);
    for (int sinks_recent : {0, 16}) {
        SCOPED_TRACE("sinks and recent " + std::to_string(sinks_recent));
        CalibrationOptions opt;
        opt.block_tokens = 16;
        opt.steps = 4;
        opt.window = 4;
        opt.sinks = opt.recent = sinks_recent;
        const CalibrationStats st = calibrate(model, "stories260K", prompts, opt);
        const Config& c = model.config();
        EXPECT_EQ(st.decode_rows, 8u);
        EXPECT_EQ(st.window_rows, 8u);
        EXPECT_EQ(st.min_prompt_tokens, int(std::min(prompts[0].size(), prompts[1].size())));
        ASSERT_EQ(st.budgets.size(), 64u);
        EXPECT_EQ(st.budgets.back(), 1.0);
        ASSERT_EQ(st.heads.size(), size_t(c.n_layers * c.n_kv_heads));
        for (int l = 0; l < c.n_layers; ++l)
            for (int g = 0; g < c.n_kv_heads; ++g) {
                const HeadCalibration& h = st.head(l, g);
                const std::string what = "layer " + std::to_string(l) + " head " + std::to_string(g);
                EXPECT_EQ(h.layer, l);
                EXPECT_EQ(h.kv_head, g);
                EXPECT_EQ(h.rows, 16u) << what;
                expect_curve(h.recall_mean, 64, what + " recall_mean");
                expect_curve(h.recall_p10, 64, what + " recall_p10");
                EXPECT_GT(h.recall_mean.front(), 0.0) << what;
                EXPECT_GE(h.entropy, 0.0) << what;
                EXPECT_LE(h.entropy, 1.0) << what;
                EXPECT_GT(h.effective_fraction, 0.0) << what;
                EXPECT_LE(h.effective_fraction, 1.0) << what;
            }

        // The JSON holds the same numbers under the documented schema.
        const json j = json::parse(st.to_json());
        EXPECT_EQ(j.at("schema"), "smartgen-calibration-stats");
        EXPECT_EQ(j.at("version"), 1);
        EXPECT_EQ(j.at("model"), "stories260K");
        EXPECT_EQ(j.at("shape").at("num_layers"), c.n_layers);
        EXPECT_EQ(j.at("shape").at("num_kv_heads"), c.n_kv_heads);
        EXPECT_EQ(j.at("shape").at("head_dim"), c.head_size());
        EXPECT_EQ(j.at("block_tokens"), 16);
        EXPECT_EQ(j.at("sinks"), sinks_recent);
        EXPECT_EQ(j.at("recent"), sinks_recent);
        EXPECT_EQ(j.at("rows").at("decode"), 8);
        EXPECT_EQ(j.at("budgets").size(), 64u);
        ASSERT_EQ(j.at("heads").size(), st.heads.size());
        for (size_t i = 0; i < st.heads.size(); ++i) {
            EXPECT_EQ(j["heads"][i].at("recall_mean").get<std::vector<double>>(), st.heads[i].recall_mean);
            EXPECT_EQ(j["heads"][i].at("recall_p10").get<std::vector<double>>(), st.heads[i].recall_p10);
        }
    }
}

TEST(Calibrate, SinksAndRecentCountAgainstTheBudget) {
    LOAD_MODEL_OR_SKIP(model, "stories260K.bin");
    auto prompts = load_prompts(data_path("prompts-tinystories.json"));
    prompts.resize(2);
    CalibrationOptions free_opt, forced_opt;
    free_opt.steps = forced_opt.steps = 2;
    free_opt.window = forced_opt.window = 2;
    forced_opt.sinks = forced_opt.recent = 16;
    const auto a = calibrate(model, "m", prompts, free_opt);
    const auto b = calibrate(model, "m", prompts, forced_opt);
    // The oracle alone picks the best blocks; forcing two of them can only lose mass at equal budget.
    for (size_t i = 0; i < a.heads.size(); ++i)
        for (size_t k = 0; k < a.budgets.size(); ++k)
            EXPECT_LE(b.heads[i].recall_mean[k], a.heads[i].recall_mean[k] + 1e-6) << "head " << i << " budget " << k;
}

TEST(Calibrate, Retrieval2kHasASparseRetrievalHeadAndADiffuseOne) {
    LOAD_MODEL_OR_SKIP(model, "retrieval2k.bin");
    auto cases = load_prompts(model_path("retrieval2k-cases.json"));
    std::sort(cases.begin(), cases.end(), [](const auto& x, const auto& y) { return x.size() < y.size(); });
    cases.resize(2);
    CalibrationOptions opt;
    opt.steps = 3;
    opt.window = 1;  // the answer's four queries: the prompt's last one and three decode steps
    const auto st = calibrate(model, "retrieval2k", cases, opt);
    // retrieval2k.md: layer 2 KV head 0 puts ~97% of its mass on the queried record; layer 0 KV
    // head 1 is diffuse (the top 1/8 of 16-token blocks hold ~17%).
    EXPECT_GE(at_budget(st, st.head(2, 0), 1.0 / 8), 0.95);
    EXPECT_LT(at_budget(st, st.head(0, 1), 1.0 / 8), 0.5);
    EXPECT_GT(st.head(0, 1).entropy, 0.9);
    EXPECT_LT(st.head(2, 0).entropy, 0.3);
}

TEST(Calibrate, RejectsBadOptions) {
    LOAD_MODEL_OR_SKIP(model, "stories260K.bin");
    const std::vector<std::vector<int>> prompts{{1, 5, 6, 7}};
    CalibrationOptions opt;
    opt.budgets = {0.25, 0.5};
    EXPECT_THROW(calibrate(model, "m", prompts, opt), EngineError);  // does not end at 1
    opt.budgets = {0.5, 0.25, 1.0};
    EXPECT_THROW(calibrate(model, "m", prompts, opt), EngineError);  // not ascending
    opt.budgets = {};
    opt.block_tokens = 0;
    EXPECT_THROW(calibrate(model, "m", prompts, opt), EngineError);
    const std::vector<std::vector<int>> too_long{std::vector<int>(size_t(model.config().seq_len) + 1, 1)};
    EXPECT_THROW(calibrate(model, "m", too_long, CalibrationOptions{}), EngineError);
    EXPECT_THROW(calibrate(model, "m", std::vector<std::vector<int>>{}, CalibrationOptions{}), EngineError);
}

// ---- shipped data -----------------------------------------------------------------------------------

TEST(Data, PromptsFileIsWellFormed) {
    const json j = json::parse(read_file(data_path("prompts-tinystories.json")));
    ASSERT_TRUE(j.is_array());
    ASSERT_GE(j.size(), 8u);
    std::set<uint64_t> seeds;
    size_t shortest = SIZE_MAX, longest = 0;
    for (const auto& p : j) {
        seeds.insert(p.at("seed").get<uint64_t>());
        const auto tokens = p.at("tokens").get<std::vector<int>>();
        EXPECT_GE(tokens.size(), 128u);
        EXPECT_LE(tokens.size(), 480u);
        EXPECT_EQ(tokens.at(0), 1);  // BOS
        for (int t : tokens) EXPECT_TRUE(t >= 0 && t < 512) << t;
        shortest = std::min(shortest, tokens.size());
        longest = std::max(longest, tokens.size());
    }
    EXPECT_EQ(seeds.size(), j.size());
    EXPECT_LE(shortest, 160u);  // lengths spread over 128..480
    EXPECT_GE(longest, 448u);
}

TEST(Data, SamplerReproducesThePromptsFile) {
    SG_NEED_DATA_FILE(model_path("stories260K.bin"));
    TempDir tmp;
    const auto r = run(std::string(SMARTGEN_SAMPLE_TOOL) + " --model " + model_path("stories260K.bin") +
                           " --count 12 --min 128 --max 480 --seed-base 1 --out " + (tmp / "p.json"),
                       tmp / "log");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(read_file(tmp / "p.json"), read_file(data_path("prompts-tinystories.json")));
}

TEST(Data, ShippedStatsAndProfilesFitTheModels) {
    struct Item {
        const char* model;
        const char* stats;
        const char* profile;
        int layers, kv_heads;
    };
    for (const Item& it : {Item{"stories260K", "stats-tinystories.json", "profile-tinystories.json", 5, 4},
                           Item{"retrieval2k", "stats-retrieval.json", "profile-retrieval.json", 4, 2}}) {
        SCOPED_TRACE(it.model);
        const json s = json::parse(read_file(data_path(it.stats)));
        EXPECT_EQ(s.at("model"), it.model);
        EXPECT_EQ(s.at("shape").at("num_layers"), it.layers);
        EXPECT_EQ(s.at("shape").at("num_kv_heads"), it.kv_heads);
        const json p = json::parse(read_file(data_path(it.profile)));
        EXPECT_EQ(p.at("version"), 1);
        EXPECT_EQ(p.at("model"), it.model);
        EXPECT_EQ(p.at("num_layers"), it.layers);
        EXPECT_EQ(p.at("num_kv_heads"), it.kv_heads);
        EXPECT_EQ(p.at("block_tokens"), s.at("block_tokens"));
        EXPECT_EQ(p.at("defaults").at("sinks"), s.at("sinks"));
        EXPECT_EQ(p.at("defaults").at("recent"), s.at("recent"));
    }
}

// ---- smartgen-profile -------------------------------------------------------------------------------

#define PROFILE_TOOL_OR_SKIP()                      \
    const std::string tool = SMARTGEN_PROFILE_TOOL; \
    if (tool.empty()) GTEST_SKIP() << "tools are not built (SMARTGEN_BUILD_TOOLS=OFF)"

// Two layers of two KV heads, budgets k/64, sinks 16 and recent 32 tokens:
//   (0,0) diffuse: recall(f) = f                 -> needs 58/64 > 0.5: dense
//   (0,1) sparse:  0.95 from the first budget    -> 1/64
//   (1,0) recall(f) = min(1, 4f)                 -> needs 15/64 (0.234375)
//   (1,1) 0.5 below f = 1/2, 0.9 from it         -> needs exactly 0.5: not dense (dense is "more than")
json synthetic_stats() {
    std::vector<double> budgets;
    for (int k = 1; k <= 64; ++k) budgets.push_back(k / 64.0);
    auto curve = [&](auto fn) {
        std::vector<double> c;
        for (double f : budgets) c.push_back(f == 1.0 ? 1.0 : fn(f));
        return c;
    };
    const std::vector<std::vector<double>> curves{
        curve([](double f) { return f; }),
        curve([](double) { return 0.95; }),
        curve([](double f) { return std::min(1.0, 4 * f); }),
        curve([](double f) { return f < 0.5 ? 0.5 : 0.9; }),
    };
    json heads = json::array();
    for (int i = 0; i < 4; ++i)
        heads.push_back({{"layer", i / 2},
                         {"kv_head", i % 2},
                         {"rows", 10},
                         {"recall_mean", curves[size_t(i)]},
                         {"recall_p10", curves[size_t(i)]},
                         {"entropy", i == 0 ? 0.99 : 0.2},
                         {"effective_fraction", 0.5}});
    return json{
        {"schema", "smartgen-calibration-stats"},
        {"version", 1},
        {"model", "synthetic"},
        {"shape", {{"num_layers", 2}, {"num_heads", 4}, {"num_kv_heads", 2}, {"head_dim", 8}, {"seq_len", 4096}}},
        {"block_tokens", 16},
        {"combine", "sum"},
        {"sinks", 16},
        {"recent", 32},
        {"steps", 4},
        {"window", 4},
        {"prompts", 1},
        {"prompt_tokens", {{"min", 1000}, {"max", 1000}, {"mean", 1000.0}}},
        {"rows", {{"decode", 4}, {"window", 4}}},
        {"budgets", budgets},
        {"heads", heads}};
}

struct Resolved {
    std::string policy;
    double fraction = 0.0;
    uint64_t sinks = 0, recent = 0;
};

// docs/profiles.md: each field from the head entry, else the layer entry, else defaults.
Resolved resolve(const json& p, int layer, int head) {
    Resolved r;
    auto take = [&](const json& rule) {
        if (rule.contains("policy")) r.policy = rule["policy"];
        if (rule.contains("budget")) r.fraction = rule["budget"].at("fraction");
        if (rule.contains("sinks")) r.sinks = rule["sinks"];
        if (rule.contains("recent")) r.recent = rule["recent"];
    };
    take(p.at("defaults"));
    if (p.contains("layers"))
        for (const auto& l : p["layers"])
            if (l.at("layer") == layer) {
                take(l);
                if (l.contains("heads"))
                    for (const auto& h : l["heads"])
                        if (h.at("head") == head) take(h);
            }
    return r;
}

// The byte fraction computed straight from docs/profiles.md's budget rules, independently of the tool.
double direct_fraction(const json& p, uint64_t n, uint64_t* sent_out = nullptr) {
    const uint64_t B = p.at("block_tokens"), L = p.at("num_layers"), G = p.at("num_kv_heads");
    const uint64_t nb = (n + B - 1) / B;
    uint64_t sent = 0;
    for (uint64_t l = 0; l < L; ++l)
        for (uint64_t g = 0; g < G; ++g) {
            const Resolved r = resolve(p, int(l), int(g));
            if (r.policy == "dense") {
                sent += nb;
                continue;
            }
            const uint64_t budget_tokens = uint64_t(std::ceil(r.fraction * double(n) - 1e-9));
            const uint64_t own = std::min(nb, (budget_tokens + B - 1) / B);
            std::set<uint64_t> forced;
            for (uint64_t b = 0; b < std::min(nb, (r.sinks + B - 1) / B); ++b) forced.insert(b);
            if (r.recent > 0)
                for (uint64_t b = r.recent >= n ? 0 : (n - r.recent) / B; b < nb; ++b) forced.insert(b);
            sent += std::min(nb, std::max<uint64_t>(own, forced.size()));
        }
    if (sent_out) *sent_out = sent;
    return double(sent) / double(L * G * nb);
}

double printed_fraction(const std::string& out) {
    std::smatch m;
    const std::regex re("proactive byte fraction: ([0-9.]+)");
    if (!std::regex_search(out, m, re)) return -1.0;
    return std::stod(m[1]);
}

TEST(Profile, DiffuseHeadIsDenseAndSparseHeadGetsASmallBudget) {
    PROFILE_TOOL_OR_SKIP();
    TempDir tmp;
    std::ofstream(tmp / "stats.json") << synthetic_stats().dump(1);
    const auto r = run(tool + " --stats " + (tmp / "stats.json") + " --target-recall 0.9 --dense-above 0.5" +
                           " --policy snapkv --tokens 1000 --out " + (tmp / "profile.json"),
                       tmp / "log");
    ASSERT_EQ(r.status, 0) << r.out;
    const json p = json::parse(read_file(tmp / "profile.json"));
    EXPECT_EQ(p.at("version"), 1);
    EXPECT_EQ(p.at("model"), "synthetic");
    EXPECT_EQ(p.at("num_layers"), 2);
    EXPECT_EQ(p.at("num_kv_heads"), 2);
    EXPECT_EQ(p.at("block_tokens"), 16);

    EXPECT_EQ(resolve(p, 0, 0).policy, "dense");
    const Resolved sparse = resolve(p, 0, 1);
    EXPECT_EQ(sparse.policy, "snapkv");
    EXPECT_DOUBLE_EQ(sparse.fraction, 1.0 / 64);
    EXPECT_EQ(sparse.sinks, 16u);
    EXPECT_EQ(sparse.recent, 32u);
    EXPECT_EQ(resolve(p, 1, 0).policy, "snapkv");
    EXPECT_DOUBLE_EQ(resolve(p, 1, 0).fraction, 15.0 / 64);
    EXPECT_EQ(resolve(p, 1, 1).policy, "snapkv");
    EXPECT_DOUBLE_EQ(resolve(p, 1, 1).fraction, 0.5);

    // 1000 tokens = 63 blocks per head: dense 63; (0,1) 16 tokens -> 1 block, but its sink block and
    // recent window (blocks 60..62) are 4; (1,0) 235 tokens -> 15; (1,1) 500 tokens -> 32.
    uint64_t sent = 0;
    const double direct = direct_fraction(p, 1000, &sent);
    EXPECT_EQ(sent, 63u + 4u + 15u + 32u);
    EXPECT_NEAR(printed_fraction(r.out), direct, 5e-7) << r.out;
    EXPECT_NE(r.out.find("114 of 252 head-blocks"), std::string::npos) << r.out;
}

TEST(Profile, PrintedFractionMatchesDirectComputationAtManyLengths) {
    PROFILE_TOOL_OR_SKIP();
    TempDir tmp;
    std::ofstream(tmp / "stats.json") << synthetic_stats().dump();
    for (uint64_t n : {1, 15, 16, 17, 40, 100, 513, 1000, 4095}) {
        const auto r = run(tool + " --stats " + (tmp / "stats.json") + " --tokens " + std::to_string(n) + " --out " +
                               (tmp / "profile.json"),
                           tmp / "log");
        ASSERT_EQ(r.status, 0) << r.out;
        const json p = json::parse(read_file(tmp / "profile.json"));
        EXPECT_NEAR(printed_fraction(r.out), direct_fraction(p, n), 5e-7) << "at " << n << " tokens:\n" << r.out;
    }
}

TEST(Profile, EverythingDenseReportsTheWholeRequest) {
    PROFILE_TOOL_OR_SKIP();
    TempDir tmp;
    std::ofstream(tmp / "stats.json") << synthetic_stats().dump();
    const std::string base = tool + " --stats " + (tmp / "stats.json") + " --tokens 1000 --dense-above 0.001 --out " +
                             (tmp / "profile.json");
    auto r = run(base, tmp / "log");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(printed_fraction(r.out), 1.0) << r.out;
    const json p = json::parse(read_file(tmp / "profile.json"));
    for (int l = 0; l < 2; ++l)
        for (int g = 0; g < 2; ++g) EXPECT_EQ(resolve(p, l, g).policy, "dense");
    // --max-fraction turns it into a failure (the profile is still written).
    r = run(base + " --max-fraction 0.5", tmp / "log");
    EXPECT_EQ(r.status, 3) << r.out;
}

TEST(Profile, RefusesBadStatsAndMismatchedSinks) {
    PROFILE_TOOL_OR_SKIP();
    TempDir tmp;
    const std::string out = " --out " + (tmp / "profile.json");
    std::ofstream(tmp / "ok.json") << synthetic_stats().dump();
    // The curves hold only for the sinks and recent window they were measured with.
    auto r = run(tool + " --stats " + (tmp / "ok.json") + " --sinks 0" + out, tmp / "log");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find("recalibrate"), std::string::npos) << r.out;
    r = run(tool + " --stats " + (tmp / "ok.json") + " --sinks 16 --recent 32" + out, tmp / "log");
    EXPECT_EQ(r.status, 0) << r.out;

    json bad = synthetic_stats();
    bad["heads"][1]["recall_mean"][3] = 0.1;  // decreases
    std::ofstream(tmp / "bad.json") << bad.dump();
    r = run(tool + " --stats " + (tmp / "bad.json") + out, tmp / "log");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find("heads[1].recall_mean"), std::string::npos) << r.out;

    bad = synthetic_stats();
    bad["heads"].erase(2);
    std::ofstream(tmp / "missing.json") << bad.dump();
    r = run(tool + " --stats " + (tmp / "missing.json") + out, tmp / "log");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find("missing"), std::string::npos) << r.out;

    r = run(tool + " --stats " + (tmp / "ok.json") + " --policy h2o" + out, tmp / "log");
    EXPECT_EQ(r.status, 2) << r.out;
}

TEST(Profile, ShippedProfilesAreReproducedFromShippedStats) {
    PROFILE_TOOL_OR_SKIP();
    TempDir tmp;
    for (const char* name : {"tinystories", "retrieval"}) {  // data for stories260K.bin, retrieval2k.bin
        SCOPED_TRACE(name);
        const std::string stats = data_path((std::string("stats-") + name + ".json").c_str());
        const std::string shipped = data_path((std::string("profile-") + name + ".json").c_str());
        // --require-validation: libsmartgen's sg_profile_parse must accept it.
        const auto r = run(tool + " --stats " + stats +
                               " --target-recall 0.9 --dense-above 0.5 --policy quest --require-validation --out " +
                               (tmp / "p.json"),
                           tmp / "log");
        ASSERT_EQ(r.status, 0) << r.out;
        EXPECT_NE(r.out.find("accepted by sg_profile_parse"), std::string::npos) << r.out;
        EXPECT_EQ(read_file(tmp / "p.json"), read_file(shipped));
        const double f = printed_fraction(r.out);
        EXPECT_GT(f, 0.0);
        EXPECT_LT(f, 1.0) << "a shipped profile must be selective";
    }
}

}  // namespace
