// examples/disagg/calibrate: attention statistics of a model, per layer and KV head, from which
// tools/smartgen-profile makes a selection profile (docs/profiles.md). Depends on engine.hpp, and on
// nlohmann/json in the .cpp only.
//
// What is measured. Each prompt is prefilled (fp32 pool) and continued greedily for `steps` tokens.
// Two kinds of query rows are looked at, both with the model's true (unmasked) attention:
//   - decode rows: each decode step, the attention of the new token over all positions
//     (AttentionProbe). Positions at or after the prompt's end (tokens generated during decode) are
//     always attended at decode time (AttendSet), so their mass counts as already recalled;
//   - window rows: the prefill's last `window` query positions t, over positions 0..t (recomputed
//     from the captured queries and the keys in the pool, in double).
// The query heads of a KV head's group are combined by summing their probabilities (divided by the
// group size, so each row is a distribution that sums to 1). The prompt part is cut into blocks of
// `block_tokens` tokens (the last one may be partial) and each block's mass is summed.
//
// For one row with t visible prompt tokens, n = ceil(t / block_tokens) blocks of masses m_j, and a
// free mass m_free (decode rows only), the recall at budget fraction f is the mass that the selector
// (runtime/select) would keep under a fraction budget f with a perfect scorer (the true attention):
//   - k = min(n, ceil(ceil(f * t) / block_tokens)) blocks (budget_blocks for a fraction budget);
//   - the head's `sinks` and `recent` tokens are always taken (F: blocks [0, ceil(sinks / B)) and
//     [(t - recent) / B, n), as Selector computes them) and count against k;
//   - the other max(k, |F|) - |F| blocks are the ones with the most mass among the rest:
//     recall(f) = (m_free + m(F) + sum of the max(k,|F|)-|F| largest other m_j) / (m_free + sum of all m_j)
// So a profile budget read off this curve is what the selector spends, sinks and recent included.
// Every row's curve is non-decreasing in f and is exactly 1 at f = 1; so is their mean.
// Diffuseness per row: H = -sum_j p_j ln p_j of the block distribution p_j = m_j / sum m (free mass
// excluded); entropy = H / ln n (0 when n = 1), effective_fraction = exp(H) / n.
//
// Stats JSON (what to_json writes and tools/smartgen-profile reads):
//   {
//     "schema": "smartgen-calibration-stats", "version": 1,
//     "model": "stories260K",                 name given by the caller (file stem by default)
//     "shape": {"num_layers": 5, "num_heads": 8, "num_kv_heads": 4, "head_dim": 8, "seq_len": 512},
//     "block_tokens": 16,
//     "combine": "sum",                        query heads of a group: summed (see above)
//     "sinks": 16, "recent": 16,               tokens always taken (see above); a profile made
//                                              from these stats must use the same values
//     "steps": 16, "window": 16,               as requested; rows below count what was run
//     "prompts": 12,
//     "prompt_tokens": {"min": 128, "max": 480, "mean": 304.0},
//     "rows": {"decode": 192, "window": 192},
//     "budgets": [0.015625, 0.03125, ..., 1.0],  ascending, last exactly 1
//     "heads": [                               layer-major: layer 0 heads 0.., layer 1 ...
//       {"layer": 0, "kv_head": 0, "rows": 384,
//        "recall_mean": [...],                 mean over rows of recall(budgets[i])
//        "recall_p10": [...],                  10th percentile over rows (nearest rank)
//        "entropy": 0.91, "effective_fraction": 0.62}   means over rows
//     ]
//   }
// Recall and diffuseness values are rounded to 6 decimals (a monotone rounding, so curves stay
// non-decreasing and end at exactly 1).
//
// Prompt files (load_prompts) are JSON arrays of objects holding the ids under "tokens" (the
// smartgen-sample-prompts format, {"seed": s, "tokens": [...]}) or "prompt" (retrieval2k-cases.json).
//
// Thread safety: calibrate() uses its own run state and pool; a Model may be shared.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine.hpp"

namespace sg::disagg {

struct CalibrationOptions {
    int block_tokens = 16;  // >= 1
    int steps = 16;         // greedy decode steps per prompt (capped at seq_len - prompt length)
    int window = 16;        // prefill's last queries per prompt (capped at the prompt length); 0 = none
    int sinks = 0;          // tokens at the start always taken, inside the budget (as in a profile rule)
    int recent = 0;         // tokens at the end always taken, inside the budget
    // Budget fractions, ascending, in (0, 1], the last exactly 1. Empty = k/64 for k = 1..64.
    std::vector<double> budgets;
};

struct HeadCalibration {
    int layer = 0, kv_head = 0;
    uint64_t rows = 0;
    std::vector<double> recall_mean;  // per budget
    std::vector<double> recall_p10;   // per budget
    double entropy = 0.0;             // mean normalised block entropy, [0, 1]
    double effective_fraction = 0.0;  // mean exp(H) / n, (0, 1]
};

struct CalibrationStats {
    std::string model;
    Config shape;
    int block_tokens = 0, steps = 0, window = 0, sinks = 0, recent = 0;
    int prompts = 0;
    int min_prompt_tokens = 0, max_prompt_tokens = 0;
    double mean_prompt_tokens = 0.0;
    uint64_t decode_rows = 0, window_rows = 0;
    std::vector<double> budgets;
    std::vector<HeadCalibration> heads;  // [layer][kv_head], layer-major

    const HeadCalibration& head(int layer, int kv_head) const {
        return heads[size_t(layer) * size_t(shape.n_kv_heads) + size_t(kv_head)];
    }
    // The stats JSON above (2-space indent, newline at the end).
    std::string to_json() const;
};

// Reads a prompt file (format above). Throws EngineError when it cannot be read or parsed, or a
// prompt is empty.
std::vector<std::vector<int>> load_prompts(const std::string& path);

// Blocks an oracle may take at budget fraction f over t visible tokens (see above): as
// runtime/select's budget_blocks for a fraction budget.
uint64_t calibration_budget_blocks(double f, uint64_t t, uint32_t block_tokens);

// Runs the model over the prompts and gathers the statistics. Throws EngineError for bad options, a
// prompt longer than the model's context, or token ids outside its vocabulary.
CalibrationStats calibrate(const Model& model, const std::string& model_name, std::span<const std::vector<int>> prompts,
                           const CalibrationOptions& options = {});

}  // namespace sg::disagg
