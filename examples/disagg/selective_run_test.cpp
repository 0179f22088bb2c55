// Tests of smartgen-disagg --mode selective as users run it (the binary, two processes, --json): that a
// selective run really decodes sparse steps, that with a budget every sparse step attends within it
// even while the speculative path delivers the rest (--attend budget, the default), that the set the
// prefill side sends as P is the runtime's own proactive set, and that the byte totals count every
// path and the page digests. Also the PSET encoding (proactive_set.hpp) on its own.
//
// The checkpoint comes from $SMARTGEN_MODEL, else $SMARTGEN_MODEL_DIR/stories260K.bin, else
// the repository's examples/models (model_files.hpp); the runs are skipped, with the reason, when it
// is missing, and fail under SMARTGEN_REQUIRE_DATA=1.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model_files.hpp"
#include "proactive_set.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace sg::disagg;

namespace {

std::string model_path() { return model_files::stories(); }

// The committed 448-token prompt (28 blocks of 16 tokens), written to a file for --prompt-tokens.
std::string long_prompt_file() {
    const json prompts = json::parse(std::ifstream(fs::path(SMARTGEN_DISAGG_DATA_DIR) / "prompts-tinystories.json"));
    for (const json& p : prompts) {
        if (p.at("tokens").size() != 448) continue;
        const fs::path f = fs::temp_directory_path() / ("sg-selective-run-test-" + std::to_string(getpid()) + ".json");
        std::ofstream(f) << p.at("tokens").dump();
        return f.string();
    }
    return "";
}

struct DisaggRun {
    int rc = -1;
    json out;
};

// Runs smartgen-disagg ARGS --json --quiet; its JSON object in out.
DisaggRun run_disagg(const std::string& args, bool with_model = true) {
    const std::string cmd = std::string(SMARTGEN_DISAGG_BINARY) +
                            (with_model ? " --model '" + model_path() + "' " : std::string(" ")) + args +
                            " --json --quiet --timeout 60";
    DisaggRun r;
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return r;
    std::string text;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
    const int st = pclose(p);
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    if (r.rc == 0) r.out = json::parse(text);
    return r;
}

#define RUN_OR_SKIP(var, args)                                                                            \
    SG_NEED_DATA_FILE(model_path());                                                                      \
    const DisaggRun var = run_disagg(args);                                                               \
    if (var.rc == 77) GTEST_SKIP() << "smartgen-disagg exited 77: the library lacks the selective paths"; \
    ASSERT_EQ(var.rc, 0) << "smartgen-disagg " << (args)

// bytes is every path's KV plus the page digests, and nothing else.
void expect_bytes_add_up(const json& j) {
    const uint64_t parts = j.at("bytes_full").get<uint64_t>() + j.at("bytes_proactive").get<uint64_t>() +
                           j.at("bytes_on_demand").get<uint64_t>() + j.at("bytes_speculative").get<uint64_t>() +
                           j.at("digest_bytes").get<uint64_t>();
    EXPECT_EQ(j.at("bytes").get<uint64_t>(), parts) << j.dump();
    EXPECT_NEAR(j.at("bytes_of_kv").get<double>(),
                double(j.at("bytes").get<uint64_t>()) / double(j.at("kv_bytes").get<uint64_t>()), 1e-5);
}

}  // namespace

TEST(ProactiveSet, PsetRoundTripsInOneMessageAndInChunks) {
    std::vector<uint32_t> P{0, 1, 5, 6, 63, 64, 98, 99};
    for (const size_t max_len : {size_t(SG_NOTIFY_MAX), size_t(60)}) {
        const std::vector<std::string> msgs = encode_pset(3, P, 100, max_len);
        EXPECT_EQ(msgs.size() == 1, max_len == SG_NOTIFY_MAX);
        ProactiveSets sets(5, 100);
        for (size_t i = 0; i < msgs.size(); ++i) {
            ASSERT_LE(msgs[i].size(), max_len);
            ASSERT_EQ(msgs[i].rfind("PSET ", 0), 0u);
            EXPECT_FALSE(sets.complete(3));
            sets.add(msgs[i].substr(5));
        }
        EXPECT_TRUE(sets.complete(3));
        EXPECT_FALSE(sets.complete(2));
        EXPECT_EQ(sets.blocks(3), P);
    }
    ProactiveSets empty(1, 7);
    empty.add(encode_pset(0, {}, 7).at(0).substr(5));
    EXPECT_TRUE(empty.complete(0));
    EXPECT_TRUE(empty.blocks(0).empty());
}

TEST(ProactiveSet, MalformedPsetIsRefused) {
    ProactiveSets sets(2, 10);
    EXPECT_THROW(sets.add("layer=2 blocks=10 first=0 bits=ff0"), std::runtime_error);  // layer out of range
    EXPECT_THROW(sets.add("layer=0 blocks=11 first=0 bits=ff0"), std::runtime_error);  // another block count
    EXPECT_THROW(sets.add("layer=0 blocks=10 first=4 bits=f0"), std::runtime_error);   // chunk out of order
    EXPECT_THROW(sets.add("layer=0 blocks=10 first=0 bits=fff"), std::runtime_error);  // block 10, 11 beyond
    EXPECT_THROW(sets.add("layer=0 blocks=10 first=0 bits=FF0"), std::runtime_error);  // not lowercase hex
    EXPECT_THROW(sets.add("layer=0 blocks=10 bits=ff0"), std::runtime_error);          // first missing
    EXPECT_THROW(encode_pset(0, {10}, 10), std::runtime_error);
    sets.add("layer=0 blocks=10 first=0 bits=f03");
    EXPECT_EQ(sets.blocks(0), (std::vector<uint32_t>{0, 1, 2, 3, 8, 9}));
}

// The case: the speculative path on (the default), and a budget. Without --attend budget, P was
// whatever had arrived (most of the prompt); now every sparse step attends within the budget.
TEST(SelectiveRun, WithTheSpeculativePathOnSparseStepsAttendWithinTheBudget) {
    const std::string prompt = long_prompt_file();
    ASSERT_FALSE(prompt.empty()) << "no 448-token prompt in prompts-tinystories.json";
    const std::string args = "--mode selective --prompt-tokens " + prompt + " --budget 0.0625 --sparse-steps 32";
    RUN_OR_SKIP(r, args);
    const DisaggRun resident = run_disagg(args + " --attend resident");
    fs::remove(prompt);
    const json& j = r.out;
    EXPECT_EQ(j.at("attend"), "budget");
    EXPECT_TRUE(j.at("speculative").get<bool>());
    EXPECT_EQ(j.at("sparse_steps"), 32);
    // 448 tokens = 28 blocks; 1/16 of them is 2 blocks per KV head (4 KV heads), for P (whose sink and
    // recent blocks are inside those 2) and for S_t alike: P has at most 8 blocks, P u S_t 16.
    const uint64_t nb = j.at("prompt_blocks"), kv_heads = 4, budget = j.at("budget_blocks");
    ASSERT_EQ(nb, 28u);
    ASSERT_EQ(budget, 2u);
    EXPECT_EQ(j.at("proactive_missing_blocks"), 0) << "P as the prefill side sent it was not all resident";
    EXPECT_LE(j.at("proactive_fraction").get<double>() * double(nb), double(kv_heads * budget) + 1e-9);
    EXPECT_LE(j.at("attended_max_blocks").get<uint64_t>(), 2 * kv_heads * budget);
    EXPECT_LT(j.at("attended_max_blocks").get<uint64_t>(), nb);
    // Digests go for the blocks a layer's proactive unit did not carry; between two processes of this
    // host (shm) every layer goes whole (stream_whole: streaming cannot be beaten there), every byte
    // proactive, and the decode side digests what it holds.
    if (j.at("bytes_speculative").get<uint64_t>() > 0)
        EXPECT_GT(j.at("digest_bytes").get<uint64_t>(), 0u);
    else
        EXPECT_EQ(j.at("bytes_proactive").get<uint64_t>(), j.at("kv_bytes").get<uint64_t>());
    expect_bytes_add_up(j);
    // --attend resident: P is everything resident at SG_LAYER_ESSENTIAL, a superset of the same P.
    ASSERT_EQ(resident.rc, 0);
    EXPECT_EQ(resident.out.at("attend"), "resident");
    EXPECT_GE(resident.out.at("proactive_fraction").get<double>(), j.at("proactive_fraction").get<double>());
}

// Without the speculative path the transfer never completes on its own: every decode step is sparse,
// and what moves is P, the on-demand blocks and the digests.
TEST(SelectiveRun, WithoutTheSpeculativePathEveryDecodeStepIsSparse) {
    RUN_OR_SKIP(r, std::string("--mode selective --budget 0.125 --speculative off"));
    const json& j = r.out;
    EXPECT_EQ(j.at("sparse_steps").get<int>(), j.at("new_tokens").get<int>() - 1);
    EXPECT_EQ(j.at("bytes_speculative"), 0);
    EXPECT_GT(j.at("bytes_on_demand").get<uint64_t>(), 0u);
    EXPECT_LT(j.at("attended_fraction").get<double>(), 1.0);
    expect_bytes_add_up(j);
}

// With neither the speculative nor the on-demand path, the blocks resident at SG_LAYER_ESSENTIAL are
// exactly the runtime's proactive set: the prefill side's copy of the selection (--attend budget) must
// be the same set, so both runs attend to the same blocks and generate the same tokens.
TEST(SelectiveRun, ThePsetThePrefillSideSendsIsTheRuntimesProactiveSet) {
    const std::string prompt = long_prompt_file();
    ASSERT_FALSE(prompt.empty());
    const std::string args =
        "--mode selective --prompt-tokens " + prompt + " --budget 0.25 --speculative off --on-demand off";
    RUN_OR_SKIP(budget, args + " --attend budget");
    const DisaggRun resident = run_disagg(args + " --attend resident");
    fs::remove(prompt);
    ASSERT_EQ(resident.rc, 0);
    EXPECT_EQ(budget.out.at("proactive_missing_blocks"), 0);
    EXPECT_EQ(budget.out.at("proactive_fraction"), resident.out.at("proactive_fraction"));
    EXPECT_EQ(budget.out.at("attended_fraction"), resident.out.at("attended_fraction"));
    EXPECT_EQ(budget.out.at("tokens"), resident.out.at("tokens"));
    EXPECT_EQ(budget.out.at("bytes_on_demand"), 0);
    EXPECT_LT(budget.out.at("bytes").get<uint64_t>(), budget.out.at("kv_bytes").get<uint64_t>());
    expect_bytes_add_up(budget.out);
}

TEST(SelectiveRun, FullTransferBytesAreTheWholeKv) {
    RUN_OR_SKIP(r, std::string("--mode full"));
    EXPECT_EQ(r.out.at("bytes"), r.out.at("kv_bytes"));
    EXPECT_EQ(r.out.at("digest_bytes"), 0);
    expect_bytes_add_up(r.out);
}

// Issue 12: parallel on-demand attention and prefetch change when blocks arrive and how the parts of
// an attention are summed, never which blocks a step attends to: with every step sparse, the tokens
// and the attended sets are those of the serial run, and the prefetch reports add up.
TEST(SelectiveRun, ParallelAttentionAndPrefetchLeaveTheTokensAsTheyAre) {
    const std::string prompt = long_prompt_file();
    ASSERT_FALSE(prompt.empty());
    // --sparse-steps: every step sparse even when fetches and prefetches complete the transfer early.
    const std::string args =
        "--mode selective --prompt-tokens " + prompt + " --budget 0.125 --speculative off --sparse-steps 63";
    RUN_OR_SKIP(serial, args + " --parallel off --prefetch off");
    const DisaggRun parallel_only = run_disagg(args + " --parallel on --prefetch off");
    const DisaggRun both = run_disagg(args + " --parallel on --prefetch on");
    const DisaggRun prefetch_only = run_disagg(args + " --parallel off --prefetch on --prefetch-scale 2");
    fs::remove(prompt);
    ASSERT_EQ(parallel_only.rc, 0);
    ASSERT_EQ(both.rc, 0);
    ASSERT_EQ(prefetch_only.rc, 0);
    EXPECT_EQ(parallel_only.out.at("tokens"), serial.out.at("tokens"));
    EXPECT_EQ(parallel_only.out.at("attended_fraction"), serial.out.at("attended_fraction"));
    for (const DisaggRun* r : {&both, &prefetch_only}) {
        EXPECT_EQ(r->out.at("tokens"), serial.out.at("tokens"));
        EXPECT_EQ(r->out.at("attended_fraction"), serial.out.at("attended_fraction"));
        EXPECT_EQ(r->out.at("sparse_steps"), serial.out.at("sparse_steps"));
        EXPECT_FALSE(r->out.at("seamless").get<bool>()) << "seamless does not apply without the speculative path";
        EXPECT_EQ(r->out.at("whole_layer_steps"), 0);
        EXPECT_TRUE(r->out.at("prefetch").get<bool>());
        // Steps after the first predict every layer: some requests, and every selected block of a
        // predicted layer that was not resident is a hit or a miss.
        EXPECT_GT(r->out.at("prefetch_calls").get<uint64_t>(), 0u);
        EXPECT_GE(r->out.at("prefetch_blocks").get<uint64_t>(), r->out.at("prefetch_calls").get<uint64_t>());
        const double rate = r->out.at("prefetch_hit_rate").is_number() ? r->out.at("prefetch_hit_rate").get<double>() : 0;
        EXPECT_GE(rate, 0.0);
        EXPECT_LE(rate, 1.0);
        expect_bytes_add_up(r->out);
    }
    EXPECT_EQ(serial.out.at("prefetch_calls"), 0);
    EXPECT_FALSE(serial.out.at("prefetch").get<bool>());
    // The serial run fetched every miss at its own step; with prefetch, fewer requests find a miss.
    EXPECT_LE(prefetch_only.out.at("fetch_calls").get<uint64_t>(), serial.out.at("fetch_calls").get<uint64_t>());
}

// Seamless (the default for the runs that measure latency): a layer attended whole at a sparse step
// is one whose blocks had all arrived, so the counts stay within the steps taken; off, none is.
TEST(SelectiveRun, SeamlessAttendsWholeOnlyWhatHasArrived) {
    RUN_OR_SKIP(on, std::string("--mode selective --budget 0.125"));
    const DisaggRun off = run_disagg("--mode selective --budget 0.125 --seamless off");
    ASSERT_EQ(off.rc, 0);
    EXPECT_TRUE(on.out.at("seamless").get<bool>());
    EXPECT_FALSE(off.out.at("seamless").get<bool>());
    EXPECT_EQ(off.out.at("whole_layer_steps"), 0);
    EXPECT_EQ(off.out.at("seamless_waited_layers"), 0);
    EXPECT_LE(on.out.at("seamless_waited_layers").get<uint64_t>(), on.out.at("whole_layer_steps").get<uint64_t>());
    EXPECT_LE(on.out.at("step2_whole_layers").get<uint64_t>(), on.out.at("whole_layer_steps").get<uint64_t>());
    expect_bytes_add_up(on.out);
    expect_bytes_add_up(off.out);
}

// An emulated run charges selection to its modelled device and takes the selections a thread computed
// ahead (select_ahead.hpp); with SMARTGEN_DISAGG_CHECK_AHEAD=1 every taken one is recomputed inline and
// a difference fails the run. The JSON names the device model, reports the CPU's selection time
// beside it, and the whole response's times.
TEST(SelectiveRun, EmulatedSelectionsAheadAreTheInlineOnes) {
    setenv("SMARTGEN_DISAGG_CHECK_AHEAD", "1", 1);
    const std::string args =
        "--mode selective --budget 0.125 --speculative off --emulate llama3-8b --emulate-tokens 2048 --max-new-tokens 8";
    const DisaggRun r = run_disagg(args, false);
    unsetenv("SMARTGEN_DISAGG_CHECK_AHEAD");
    ASSERT_EQ(r.rc, 0) << "smartgen-disagg " << args;
    const json& j = r.out;
    EXPECT_EQ(j.at("emulated").get<bool>(), true);
    EXPECT_NE(j.at("device_model").get<std::string>().find("modelled accelerator"), std::string::npos);
    EXPECT_EQ(j.at("sparse_steps").get<uint64_t>(), 7u);
    // Every sparse step selects every layer (32) unless the layer was whole: all from the thread,
    // or inline when late; none lost.
    const uint64_t ahead = j.at("selections_ahead").get<uint64_t>(), late = j.at("selections_late").get<uint64_t>();
    EXPECT_GT(ahead, 0u);
    EXPECT_LE(ahead + late, 7u * 32u);
    EXPECT_GT(j.at("selector_cpu_ms").get<double>(), 0.0);
    EXPECT_GT(j.at("stall_selector_modelled_ms").get<double>(), 0.0);
    // e2e is t0 -> the last token; TPOT's steps are all sparse here.
    EXPECT_NEAR(j.at("e2e_ms").get<double>(),
                j.at("ttst_ms").get<double>() + 6 * j.at("tpot_ms").get<double>(), 0.5);
    // (A step's own time, without what the decode loop does between steps: no more than TPOT.)
    EXPECT_LE(j.at("tpot_sparse_ms").get<double>(), j.at("tpot_ms").get<double>() * 1.0001);
    EXPECT_GT(j.at("tpot_sparse_ms").get<double>(), 0.5 * j.at("tpot_ms").get<double>());
    EXPECT_TRUE(j.at("tpot_dense_ms").is_null());
}
