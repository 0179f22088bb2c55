// examples/disagg/select_ahead: the decode side's per-step selection of an emulated run, computed on a
// thread of its own ahead of the step that uses it.
//
// Why: an emulated run charges every compute cost of a decode step to one modelled accelerator
// (emulate.hpp). On such a device the selection of a layer (scoring its page digests against the
// step's query, then top-k) is two short kernels, tens of microseconds for a whole step; this CPU
// needs milliseconds for the same arithmetic. Run inline, that CPU time would sit in the step's wall
// time beside modelled attention, a mix of two devices that no deployment pays. So the step charges
// the modelled kernels (SelectionCost) and takes the result from here; this thread computes exactly
// what the selector computes inline (same selector profile, same digests, same query), and its CPU
// time is reported beside the model, not in it. A result that is not ready when the step needs it is
// computed inline by the caller and counted (late), so nothing is assumed.
//
// What makes it possible, and exact: an emulated step's queries depend only on the layer's key pattern
// and the step's index (SyntheticKeys::decode_query), and layers of one pattern hold byte-identical
// keys, hence identical digests. With a profile that is the same for every layer (the --budget
// profiles), one selection per (step, pattern) serves every layer of that pattern; with per-layer
// rules, one per (step, layer). A check mode (SMARTGEN_DISAGG_CHECK_AHEAD=1) recomputes every
// result taken inline and fails the run on any difference.
#pragma once

#include <smartgen/smartgen.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emulate.hpp"

namespace sg::disagg {

// The modelled accelerator's cost of one layer's selection: the digests read once at the decode
// bandwidth, plus a launch per kernel (scores, top-k).
struct SelectionCost {
    // A kernel launch as CUDA graphs and streams see it: 3-5 us; the larger figure.
    static constexpr double kLaunchS = 5e-6;
    static constexpr int kKernelsPerSelection = 2;  // scores over the digests, top-k
    static constexpr int kKernelsPerMerge = 1;      // the log-sum-exp merge of two partial attentions

    double select_s(double digest_bytes, double bandwidth) const {
        return digest_bytes / bandwidth + kKernelsPerSelection * kLaunchS;
    }
    double merge_s() const { return kKernelsPerMerge * kLaunchS; }
};

class SelectionAhead {
  public:
    // profile_json: the decode-side profile (this thread parses its own copy and makes its own
    // selector: selectors are not thread-safe). uniform: every layer has the same rules.
    SelectionAhead(sg_transfer_t x, const std::string& profile_json, const sg_kv_layout_t& layout, uint64_t prompt_len,
                   const SyntheticKeys& keys, int layers, int q_heads, int head_dim, bool uniform, int lookahead_steps);
    ~SelectionAhead();
    SelectionAhead(const SelectionAhead&) = delete;
    SelectionAhead& operator=(const SelectionAhead&) = delete;

    // The decode side is at `step` (0 for the first decode step): compute up to step + lookahead and
    // forget what is older.
    void at_step(uint64_t step);
    // Layer l's selection at the current step, if computed: its blocks (ascending) in `out`.
    bool take(int layer, std::vector<uint32_t>& out);
    // No more sparse steps: the thread stops.
    void stop();
    // Whether a check of every taken result was asked for (SMARTGEN_DISAGG_CHECK_AHEAD=1).
    static bool check_requested();

    uint64_t cpu_ns() const { return cpu_ns_.load(); }
    uint64_t computed() const { return computed_.load(); }
    // A thrown error of the thread ("" when none): the caller reports it instead of using results.
    std::string error() const;

  private:
    int representative(int layer) const { return uniform_ ? keys_.pattern_of(layer) : layer; }
    void run();
    bool digests_ready(int layer);
    bool all_whole(int rep);  // every layer rep serves is whole (resident): none needs a selection

    sg_transfer_t x_;
    const SyntheticKeys& keys_;
    const int layers_, q_heads_, head_dim_;
    const bool uniform_;
    const int lookahead_;
    sg_profile_t profile_ = nullptr;
    sg_selector_t selector_ = nullptr;
    size_t digest_floats_ = 0;
    uint32_t max_blocks_ = 0;
    std::vector<std::vector<float>> digests_;  // per representative layer, once loaded

    mutable std::mutex mu_;
    std::condition_variable cv_;
    uint64_t step_ = 0;
    bool stop_ = false;
    std::string error_;
    std::map<uint64_t, std::vector<std::vector<uint32_t>>> results_;  // step -> [representative] blocks
    std::map<uint64_t, std::vector<uint8_t>> done_;                     // step -> [representative] computed
    std::atomic<uint64_t> cpu_ns_{0}, computed_{0};
    std::thread thread_;
};

}  // namespace sg::disagg
