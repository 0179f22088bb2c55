// Tests of examples/disagg/quality: the oracle's pick, the profile it builds, that a whole-prompt
// budget is full attention, and the selection-quality thresholds on stories260K (docs/quality.md).
//
// The checkpoint comes from $SMARTGEN_MODEL, else $SMARTGEN_MODEL_DIR/stories260K.bin, else
// the repository's examples/models (model_files.hpp); tests that need it are skipped, with the reason,
// when it is missing, and fail under SMARTGEN_REQUIRE_DATA=1.
#include "quality.hpp"

#include <gtest/gtest.h>
#include <smartgen/smartgen.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "calibrate.hpp"
#include "model_files.hpp"

namespace fs = std::filesystem;
using namespace sg::disagg;

namespace {

std::string model_path() { return model_files::stories(); }

#define LOAD_MODEL_OR_SKIP(var)        \
    SG_NEED_DATA_FILE(model_path());   \
    const Model var = Model::load(model_path())

std::vector<std::vector<int>> committed_prompts() {
    return load_prompts((fs::path(SMARTGEN_DISAGG_DATA_DIR) / "prompts-tinystories.json").string());
}

}  // namespace

TEST(Quality, TopBlocksTakesTheLargestTiesToTheLowerIndexAscending) {
    const std::vector<double> mass{0.1, 0.4, 0.2, 0.4, 0.0, 0.3};
    EXPECT_EQ(top_blocks(mass, 0), std::vector<uint32_t>{});
    EXPECT_EQ(top_blocks(mass, 1), std::vector<uint32_t>{1});
    EXPECT_EQ(top_blocks(mass, 3), (std::vector<uint32_t>{1, 3, 5}));
    EXPECT_EQ(top_blocks(mass, 4), (std::vector<uint32_t>{1, 2, 3, 5}));
    EXPECT_EQ(top_blocks(mass, 99), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
}

TEST(Quality, BudgetProfileIsQuestWithOneBlockOfSinksAndRecent) {
    const std::string json = budget_profile("stories260K", 5, 4, 8, 0.125);
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_profile_t profile = nullptr;
    ASSERT_EQ(sg_profile_parse(json.data(), json.size(), &profile, &err), SG_OK) << err.message;
    size_t len = 0;
    sg_profile_to_json(profile, nullptr, 0, &len);
    std::string canonical(len + 1, '\0');
    ASSERT_EQ(sg_profile_to_json(profile, canonical.data(), canonical.size(), &len), SG_OK);
    sg_profile_destroy(profile);
    for (const char* field : {"\"quest\"", "\"fraction\"", "0.125", "\"sinks\"", "\"recent\""})
        EXPECT_NE(canonical.find(field), std::string::npos) << field << " missing from " << canonical;
}

TEST(Quality, BudgetProfileTakesThePolicyAndCanLeaveOutSinksAndRecent) {
    const std::string json = budget_profile("stories260K", 5, 4, 8, 0.125, "snapkv", false);
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_profile_t profile = nullptr;
    ASSERT_EQ(sg_profile_parse(json.data(), json.size(), &profile, &err), SG_OK) << err.message;
    sg_profile_destroy(profile);
    EXPECT_NE(json.find("\"policy\": \"snapkv\""), std::string::npos) << json;
    EXPECT_NE(json.find("\"sinks\": 0"), std::string::npos) << json;
    EXPECT_NE(json.find("\"recent\": 0"), std::string::npos) << json;
}

// A budget of the whole prompt makes P every block: each set and its oracle are full attention.
TEST(Quality, WholePromptBudgetAgreesEverywhere) {
    LOAD_MODEL_OR_SKIP(model);
    auto prompts = committed_prompts();
    prompts.resize(2);
    QualityOptions o;
    o.budgets = {1.0};
    o.new_tokens = 24;
    const QualityReport r = measure_quality(model, prompts, o);
    ASSERT_EQ(r.cells.size(), 2u);
    for (const auto& cell : r.cells)
        for (const auto& p : cell.prompts) {
            EXPECT_DOUBLE_EQ(p.proactive, 1.0);
            EXPECT_DOUBLE_EQ(p.recall, 1.0);
            for (const SetScores* s : {&p.with_on_demand, &p.proactive_only}) {
                EXPECT_DOUBLE_EQ(s->attended, 1.0);
                EXPECT_DOUBLE_EQ(s->teacher_forced, 1.0);
                EXPECT_DOUBLE_EQ(s->teacher_forced_oracle, 1.0);
                EXPECT_DOUBLE_EQ(s->free_running, 1.0);
                EXPECT_DOUBLE_EQ(s->free_running_oracle, 1.0);
            }
        }
}

TEST(Quality, PromptsTooLongForTheNewTokensAreLeftOut) {
    LOAD_MODEL_OR_SKIP(model);
    const auto prompts = committed_prompts();
    QualityOptions o;
    o.budgets = {0.5};
    o.block_tokens = {16};
    o.new_tokens = 2;
    const int seq_len = model.config().seq_len;
    std::vector<std::vector<int>> two{prompts.front(), std::vector<int>(size_t(seq_len), 1)};
    const QualityReport r = measure_quality(model, two, o);
    EXPECT_EQ(r.prompt_tokens, std::vector<int>{int(prompts.front().size())});
    EXPECT_EQ(r.skipped_prompt_tokens, std::vector<int>{seq_len});
}

// The selection-quality thresholds (docs/quality.md). The target is P u S_t u G's teacher-forced
// agreement >= 0.90 x the oracle's at budgets 1/2, 1/4 and 1/8. On stories260K, whose attention is
// diffuse, it holds at 1/2 only (measured 0.77/0.71 at 1/4 and 0.61/0.62 at 1/8 for 8/16-token
// blocks: the decode side's Quest scores on 8-dimensional digests are a weak predictor there); what
// is asserted there is the 1/2 target and that the on-demand path adds agreement at every budget.
// On retrieval2k, whose answers hang on a few KV entries, the target is asserted at all three.
TEST(Quality, OnStories260KTheTargetHoldsAtHalfBudgetAndOnDemandAddsAgreementEverywhere) {
    LOAD_MODEL_OR_SKIP(model);
    const auto prompts = committed_prompts();
    QualityOptions o;
    o.budgets = {0.5, 0.25, 0.125};
    const QualityReport r = measure_quality(model, prompts, o);
    std::printf("%s", r.to_text().c_str());
    ASSERT_GE(r.prompt_tokens.size(), 8u);
    ASSERT_EQ(r.cells.size(), 6u);
    for (const auto& cell : r.cells) {
        const SetScores& s = cell.mean.with_on_demand;
        const SetScores& p = cell.mean.proactive_only;
        if (cell.budget == 0.5) {
            EXPECT_GE(s.teacher_forced, 0.90 * s.teacher_forced_oracle)
                << "block " << cell.block_tokens << ": teacher-forced agreement " << s.teacher_forced << ", oracle "
                << s.teacher_forced_oracle;
        }
        EXPECT_GT(s.teacher_forced, p.teacher_forced)
            << "block " << cell.block_tokens << ", budget " << cell.budget << ": on-demand adds nothing";
    }
}

TEST(Quality, OnRetrieval2kProactivePlusOnDemandIsWithinTenPercentOfTheOracle) {
    const fs::path r2k = model_files::path("retrieval2k.bin"), cases = model_files::path("retrieval2k-cases.json");
    SG_NEED_DATA_FILE(r2k.string());
    SG_NEED_DATA_FILE(cases.string());
    const Model model = Model::load(r2k.string());
    auto prompts = load_prompts(cases.string());
    prompts.resize(std::min<size_t>(prompts.size(), 8));  // 16 in docs/quality.md; 8 keep the ASan run short
    QualityOptions o;
    o.budgets = {0.5, 0.25, 0.125};
    o.new_tokens = 16;
    o.model_name = "retrieval2k";
    const QualityReport r = measure_quality(model, prompts, o);
    std::printf("%s", r.to_text().c_str());
    ASSERT_GE(r.prompt_tokens.size(), 8u);
    for (const auto& cell : r.cells) {
        const SetScores& s = cell.mean.with_on_demand;
        EXPECT_GE(s.teacher_forced, 0.90 * s.teacher_forced_oracle)
            << "block " << cell.block_tokens << ", budget " << cell.budget << ": teacher-forced agreement "
            << s.teacher_forced << ", oracle " << s.teacher_forced_oracle;
    }
}
