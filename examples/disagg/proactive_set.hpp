// examples/disagg/proactive_set: the proactive set P of each layer, as the decode side of
// smartgen-disagg learns it for `--attend budget`.
//
// The runtime sends each layer's essential blocks (its choice with the transfer's profile) but does
// not tell the decode side which blocks those were, and residency cannot say it: by the time decode
// looks, the speculative path has usually delivered more (on loopback, most of the prompt). So the
// prefill side makes the same choice itself with the public selector API, from the same inputs the
// runtime's proactive path uses (the transfer's profile, the layer's window queries, its keys through
// the request's block table, its page digests; the selector is the runtime's code and breaks ties
// towards the lower block, docs/profiles.md), and sends it in "PSET" notifications. The decode side
// checks each block of it against residency at SG_LAYER_ESSENTIAL (they must all be there) and counts
// the ones that are not.
//
// Depends on the public header only (and pool_layout.hpp's layout, which the caller passes in).
#pragma once

#include <smartgen/smartgen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sg::disagg {

// The prefill side's copy of the proactive selection. Not thread-safe (one selector, scratch reused).
class ProactiveMirror {
  public:
    // profile: the transfer's (borrowed for the call; the selector keeps what it needs). layout: the
    // prefill pool (its base pointers are read at select()). table: the request's block table, at least
    // ceil(num_tokens / tokens_per_block) entries. Throws std::runtime_error naming the failed call.
    ProactiveMirror(sg_profile_t profile, const sg_kv_layout_t& layout, uint64_t num_tokens,
                    const std::vector<uint32_t>& table);
    ~ProactiveMirror();
    ProactiveMirror(const ProactiveMirror&) = delete;
    ProactiveMirror& operator=(const ProactiveMirror&) = delete;

    // P of one layer, ascending logical block indices: what sg_transfer_layer_written_q(queries, W,
    // q_heads) makes the runtime send on the proactive path. queries may be NULL with W = 0 (the
    // profile's policies must then not need them, as for the runtime).
    const std::vector<uint32_t>& select(uint32_t layer, const float* queries, uint32_t num_queries,
                                        uint32_t num_q_heads);
    // The profile's budget of the layer in blocks, per KV head (sg_selector_budget_blocks).
    uint64_t budget_blocks(uint32_t layer) const;
    uint32_t num_blocks() const { return nb_; }
    uint64_t ns = 0;  // time spent in select(), all layers

  private:
    sg_selector_t sel_ = nullptr;
    sg_kv_layout_t layout_;
    std::vector<uint32_t> table_;
    uint32_t nb_ = 0;
    std::vector<float> digests_;
    std::vector<uint32_t> out_;
};

// Makes each layer's P on a thread of its own and sends its PSET messages as soon as it is made, so
// the engine's layer hook only copies the queries (the selection reads the layer's keys; at 8K tokens
// of an emulated Llama-3-8B that is several ms per layer, which would otherwise land in TTFT).
class ProactiveSender {
  public:
    // send: called on the sender's thread with each message (sg_session_notify is thread-safe).
    ProactiveSender(std::unique_ptr<ProactiveMirror> mirror, std::function<void(const std::string&)> send);
    ~ProactiveSender();  // stops the thread; posted layers not yet sent are dropped
    ProactiveSender(const ProactiveSender&) = delete;
    ProactiveSender& operator=(const ProactiveSender&) = delete;

    // Queues layer `layer` (queries copied: [num_queries][num_q_heads][head_dim] floats).
    void post(uint32_t layer, const float* queries, uint32_t num_queries, uint32_t num_q_heads, size_t head_dim);
    // Waits until every posted layer was sent; rethrows what the thread threw. Returns the thread's
    // time in selection (ns).
    uint64_t finish();

  private:
    struct Job {
        uint32_t layer, num_queries, num_q_heads;
        std::vector<float> queries;
    };
    void run();

    std::unique_ptr<ProactiveMirror> mirror_;
    std::function<void(const std::string&)> send_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> jobs_;
    bool stop_ = false, busy_ = false;
    std::exception_ptr error_;
    std::thread thread_;
};

// Whether the loaded libsmartgen has the selector calls ProactiveMirror uses (they are weak here, as
// in main.cpp, so the program still runs its full modes against a library without them).
bool proactive_mirror_available();

// A layer's P as notification bodies of at most max_len bytes each: "PSET layer=L blocks=NB first=F
// bits=HEX", HEX the bitmap of blocks F.. (bit i of nibble j is block F + 4j + i; F a multiple of 4),
// one message per chunk, the first with first=0, all of them together covering blocks 0..NB-1.
std::vector<std::string> encode_pset(uint32_t layer, const std::vector<uint32_t>& blocks, uint32_t num_blocks,
                                     size_t max_len = SG_NOTIFY_MAX);

// Collects PSET messages on the decode side.
class ProactiveSets {
  public:
    ProactiveSets(uint32_t layers, uint32_t num_blocks);
    // Takes one PSET body (the text after "PSET "). Throws std::runtime_error when it is malformed,
    // names another block count, a layer out of range, or blocks beyond the request.
    void add(const std::string& body);
    // Whether the layer's whole bitmap has arrived.
    bool complete(uint32_t layer) const { return have_[layer] >= nb_; }
    // The layer's P, ascending (only when complete()).
    std::vector<uint32_t> blocks(uint32_t layer) const;

  private:
    uint32_t nb_;
    std::vector<uint64_t> have_;              // [layer] blocks covered so far
    std::vector<std::vector<uint8_t>> bits_;  // [layer][block] 0/1
};

}  // namespace sg::disagg
