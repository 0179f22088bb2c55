// examples/disagg/quality: how close selective decode's choice of prompt blocks comes to the best
// possible choice of the same size, measured on a real model. Depends on engine.hpp and on SmartGen's
// public header (profiles and selectors); nlohmann/json in the .cpp only.
//
// What is decoded. Each prompt is prefilled (fp32 pool, full attention) with the last `window` prompt
// queries captured; token 1 is the prefill's argmax. Steps 2..N are sparse: at each one, layer l
// attends to the union of
//   P   the proactive set: sg_selector_select on the prefill's last `window` queries of layer l, with
//       the prefill side's profile smartgen-disagg builds from --budget and --proactive-policy
//       (main.cpp's budget_profile_json; here QualityOptions::proactive_policy): SnapKV (default:
//       the window queries' exact attention over the prompt's keys, which the prefill side holds)
//       or Quest (the last window query against the page digests), sinks one block, recent one
//       block. What the runtime's proactive path moves is exactly this selection, so P is what a
//       disaggregated decode holds;
//   S_t the decode-time selection: sg_selector_select with the step's query of layer l on the layer's
//       page digests (sg_selector_digest over the prompt), with the decode side's profile: Quest
//       (the decode side has the digests, not the keys), the same budget, no sinks or recent window
//       (P holds them already, so the whole budget goes to scored blocks);
//   G   every generated token (the engine always attends to positions >= the prompt's end).
// The "proactive only" set is P ∪ G: what decode sees without the on-demand path.
//
// The oracle. For a set of k blocks at some step and layer, the oracle takes instead the k prompt
// blocks holding the most true attention of that step: the softmax of the step's query of that layer
// over positions 0..pos, summed over the query heads and over each block's tokens (ties go to the
// lower block). k follows the set it stands beside: |P_l ∪ S_t,l| (S_t from the oracle run's own
// query) or |P_l|. Nothing of the oracle is available to a real decode; it bounds what any selector
// of that size could do.
//
// Metrics, per prompt, then averaged over prompts (N - 1 sparse steps per prompt):
//   teacher_forced  the full-attention tokens are fed, and the fraction of steps whose argmax equals
//                   the full-attention token is counted;
//   free_running    the set's own tokens are fed; the length of the common prefix of tokens 2..N with
//                   the full-attention tokens, divided by N - 1 (token 1 comes from the full prefill);
//   recall          at the first decode step (full attention's query at position n), the fraction of
//                   each query head's attention mass over the prompt that falls in P, averaged over
//                   layers and heads; recall_oracle the same for the oracle's |P_l| blocks;
//   attended        mean over steps and layers of the attended prompt blocks / the prompt's blocks
//                   (the union over KV heads can exceed the per-head budget);
//   mass_recall     mean over the teacher-forced steps and layers of the fraction of the step's true
//                   attention over the prompt (summed over query heads) that the set holds;
//                   mass_recall_oracle the same for the oracle of the set's size at that step.
//
// Prompts that cannot be continued for N tokens within the model's context are left out and listed.
//
// Thread safety: measure_quality uses its own pool, run state and selectors; a Model may be shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine.hpp"

namespace sg::disagg {

struct QualityOptions {
    std::vector<int> block_tokens{8, 16};
    std::vector<double> budgets{0.5, 0.25, 0.125, 0.0625};  // fractions of the prompt's tokens, in (0, 1]
    int new_tokens = 64;                                    // N >= 2: token 1, then N - 1 sparse steps
    int window = 8;                                         // prefill queries the proactive selection sees
    std::string model_name = "stories260K";                 // the profile's "model" field
    // P's policy: "snapkv" (the window queries' exact attention over the prompt's keys, which the
    // prefill side holds) or "quest" (the last window query against the page digests). S_t is always
    // quest: the decode side holds only the digests.
    std::string proactive_policy = "snapkv";
    // In-flight quantization (SG_WIRE_QUANT_*): when set, the prompt's KV reaches the pool decode
    // attends to through a real SmartGen transfer with that wire_quant between two contexts of
    // this process, so decode runs on what the runtime delivers (codes times scales); selection (P,
    // the digests) and the full-attention reference stay on the prefill side's own fp32 KV.
    uint32_t wire_quant = 0;
    std::function<void(const std::string&)> progress;  // optional: one line per (prompt, block size)
};

// One set's scores beside its oracle's, for one prompt or averaged over prompts.
struct SetScores {
    double attended = 0.0;
    double teacher_forced = 0.0, teacher_forced_oracle = 0.0;
    double free_running = 0.0, free_running_oracle = 0.0;
    double mass_recall = 0.0, mass_recall_oracle = 0.0;
};

struct PromptQuality {
    int prompt_tokens = 0;
    double proactive = 0.0;  // |P| / prompt blocks, mean over layers
    double recall = 0.0, recall_oracle = 0.0;
    SetScores with_on_demand;  // P ∪ S_t ∪ G
    SetScores proactive_only;  // P ∪ G
};

// One (block size, budget): per-prompt results and their means.
struct QualityCell {
    int block_tokens = 0;
    double budget = 0.0;
    std::vector<PromptQuality> prompts;
    PromptQuality mean;  // prompt_tokens: the mean prompt length, rounded down
};

struct QualityReport {
    std::string model;
    Config shape;
    int new_tokens = 0, window = 0;
    uint32_t wire_quant = 0;                 // QualityOptions::wire_quant
    // With wire_quant: the pool bytes the transfers delivered and what they took on the wire, summed
    // over prompts and block sizes (sg_transfer_stats' quantized_bytes, quantized_wire_bytes).
    uint64_t quantized_bytes = 0, quantized_wire_bytes = 0;
    std::vector<int> prompt_tokens;          // lengths of the prompts measured, in input order
    std::vector<int> skipped_prompt_tokens;  // lengths of those left out (too long for N more tokens)
    std::vector<QualityCell> cells;          // block size major, budgets in the order given
    double seconds = 0.0;                    // wall time of the measurement

    // JSON (2-space indent, newline at the end): the settings, every cell's means and per-prompt values.
    std::string to_json() const;
    // The tables of docs/quality.md: agreement per cell and set beside the oracle, then P's recall.
    std::string to_markdown() const;
    // The same tables as aligned plain text for a terminal.
    std::string to_text() const;
};

// The k indices of the largest masses, ties to the lower index, returned ascending (the oracle's pick).
std::vector<uint32_t> top_blocks(std::span<const double> mass, size_t k);

// The profile JSONs smartgen-disagg builds from --budget f with block size B (docs/profiles.md): the
// given policy, budget f per KV head; sinks and recent one block each, or none. The prefill side's
// (P) is (--proactive-policy, true), the decode side's (S_t) is ("quest", false).
std::string budget_profile(const std::string& model, int layers, int kv_heads, int block_tokens, double fraction,
                           const std::string& policy = "quest", bool sinks_and_recent = true);

// Runs the measurement. Throws EngineError for bad options, a prompt with ids outside the vocabulary,
// no prompt that fits, or a SmartGen call that fails (the message names the call and its status).
QualityReport measure_quality(const Model& model, std::span<const std::vector<int>> prompts,
                              const QualityOptions& options = {});

}  // namespace sg::disagg
