#include "select_ahead.hpp"

#include <time.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace sg::disagg {

namespace {

uint64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

void need(sg_status_t st, const char* what) {
    if (st != SG_OK) throw std::runtime_error(std::string(what) + ": " + sg_status_str(st));
}

}  // namespace

SelectionAhead::SelectionAhead(sg_transfer_t x, const std::string& profile_json, const sg_kv_layout_t& layout,
                               uint64_t prompt_len, const SyntheticKeys& keys, int layers, int q_heads, int head_dim,
                               bool uniform, int lookahead_steps)
    : x_(x),
      keys_(keys),
      layers_(layers),
      q_heads_(q_heads),
      head_dim_(head_dim),
      uniform_(uniform),
      lookahead_(lookahead_steps) {
    need(sg_profile_parse(profile_json.data(), profile_json.size(), &profile_, nullptr), "sg_profile_parse (ahead)");
    if (sg_selector_create(profile_, &layout, prompt_len, &selector_, nullptr) != SG_OK) {
        sg_profile_destroy(profile_);
        throw std::runtime_error("sg_selector_create (ahead) failed");
    }
    need(sg_selector_digest_floats(selector_, &digest_floats_), "sg_selector_digest_floats (ahead)");
    max_blocks_ = keys.blocks();
    digests_.resize(size_t(uniform_ ? keys_.patterns() : layers_));
    thread_ = std::thread([this] { run(); });
}

SelectionAhead::~SelectionAhead() {
    stop();
    if (thread_.joinable()) thread_.join();
    sg_selector_destroy(selector_);
    sg_profile_destroy(profile_);
}

bool SelectionAhead::check_requested() {
    const char* v = std::getenv("SMARTGEN_DISAGG_CHECK_AHEAD");
    return v && std::strcmp(v, "1") == 0;
}

void SelectionAhead::at_step(uint64_t step) {
    std::lock_guard lock(mu_);
    step_ = step;
    results_.erase(results_.begin(), results_.lower_bound(step));
    done_.erase(done_.begin(), done_.lower_bound(step));
    cv_.notify_all();
}

bool SelectionAhead::take(int layer, std::vector<uint32_t>& out) {
    std::lock_guard lock(mu_);
    const auto d = done_.find(step_);
    const size_t r = size_t(representative(layer));
    if (d == done_.end() || !d->second[r]) return false;
    out = results_[step_][r];
    return true;
}

void SelectionAhead::stop() {
    std::lock_guard lock(mu_);
    stop_ = true;
    cv_.notify_all();
}

std::string SelectionAhead::error() const {
    std::lock_guard lock(mu_);
    return error_;
}

bool SelectionAhead::all_whole(int rep) {
    for (int l = 0; l < layers_; ++l) {
        if (representative(l) != rep) continue;
        uint32_t state = 0;
        need(sg_transfer_layer_state(x_, uint32_t(l), &state), "sg_transfer_layer_state (ahead)");
        if (!(state & SG_LAYER_READY)) return false;
    }
    return true;
}

bool SelectionAhead::digests_ready(int layer) {
    std::vector<float>& d = digests_[size_t(layer)];
    if (!d.empty()) return true;
    uint32_t state = 0;
    need(sg_transfer_layer_state(x_, uint32_t(layer), &state), "sg_transfer_layer_state (ahead)");
    if (!(state & SG_LAYER_ESSENTIAL)) return false;  // the digests come with the essential blocks
    d.resize(digest_floats_);
    size_t n = 0;
    need(sg_transfer_digests(x_, uint32_t(layer), d.data(), d.size(), &n), "sg_transfer_digests (ahead)");
    return true;
}

void SelectionAhead::run() {
    // Everything this thread throws becomes error(): it must not end the host process.
    try {
        const size_t reps = digests_.size();
        std::vector<float> q(size_t(q_heads_) * size_t(head_dim_));
        std::vector<uint32_t> blocks(max_blocks_);
        for (;;) {
            uint64_t step = 0;
            int rep = -1;
            {
                std::unique_lock lock(mu_);
                // The first representative not yet computed, from the current step on.
                for (;;) {
                    if (stop_) return;
                    for (uint64_t s = step_; s <= step_ + uint64_t(lookahead_) && rep < 0; ++s) {
                        auto& done = done_[s];
                        done.resize(reps, 0);
                        for (size_t r = 0; r < reps; ++r)
                            if (!done[r]) {
                                step = s;
                                rep = int(r);
                                break;
                            }
                    }
                    if (rep >= 0) break;
                    cv_.wait(lock);
                }
            }
            const uint64_t c0 = thread_cpu_ns();
            if (all_whole(rep)) {  // every layer it serves is attended whole: nothing to select
                std::lock_guard lock(mu_);
                if (step >= step_) {
                    done_[step].resize(reps, 0);
                    done_[step][size_t(rep)] = 1;
                    results_[step].resize(reps);
                }
                continue;
            }
            const bool ready = digests_ready(rep);
            if (!ready) {  // the layer's essential blocks are not here yet: look again shortly
                cpu_ns_ += thread_cpu_ns() - c0;
                std::unique_lock lock(mu_);
                cv_.wait_for(lock, std::chrono::microseconds(200));
                continue;
            }
            keys_.decode_query(keys_.pattern_of(rep), step, q.data());
            sg_selector_input_t in;
            sg_selector_input_init(&in);
            in.queries = q.data();
            in.num_queries = 1;
            in.num_q_heads = uint32_t(q_heads_);
            in.digests = digests_[size_t(rep)].data();
            size_t count = 0;
            need(sg_selector_select(selector_, uint32_t(rep), &in, blocks.data(), blocks.size(), &count),
                 "sg_selector_select (ahead)");
            cpu_ns_ += thread_cpu_ns() - c0;
            computed_ += 1;
            std::lock_guard lock(mu_);
            if (step < step_) continue;  // the decode side moved past it meanwhile
            auto& res = results_[step];
            res.resize(reps);
            res[size_t(rep)].assign(blocks.begin(), blocks.begin() + ptrdiff_t(count));
            done_[step].resize(reps, 0);
            done_[step][size_t(rep)] = 1;
        }
    } catch (const std::exception& e) {
        std::lock_guard lock(mu_);
        error_ = e.what();
    } catch (...) {
        std::lock_guard lock(mu_);
        error_ = "unknown exception";
    }
}

}  // namespace sg::disagg
