// examples/disagg/proactive_set.cpp: see proactive_set.hpp.
#include "proactive_set.hpp"

#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

// Weak, as in main.cpp: a library without the selective paths still loads (see proactive_mirror_available).
#pragma weak sg_selector_create
#pragma weak sg_selector_destroy
#pragma weak sg_selector_digest
#pragma weak sg_selector_digest_floats
#pragma weak sg_selector_input_init
#pragma weak sg_selector_select
#pragma weak sg_selector_budget_blocks

namespace sg::disagg {

namespace {

void check(sg_status_t st, const char* what, const sg_error_info_t* err = nullptr) {
    if (st == SG_OK) return;
    const std::string detail = err && err->message[0] ? err->message : sg_last_error_message();
    throw std::runtime_error(std::string(what) + " failed: " + sg_status_str(st) + (detail.empty() ? "" : ": ") +
                             detail);
}

uint64_t now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

[[noreturn]] void bad_pset(const std::string& body, const std::string& why) {
    throw std::runtime_error("malformed PSET message (" + why + "): '" + body.substr(0, 80) + "'");
}

}  // namespace

bool proactive_mirror_available() {
    return sg_selector_create && sg_selector_destroy && sg_selector_digest && sg_selector_digest_floats &&
           sg_selector_input_init && sg_selector_select && sg_selector_budget_blocks;
}

ProactiveMirror::ProactiveMirror(sg_profile_t profile, const sg_kv_layout_t& layout, uint64_t num_tokens,
                                 const std::vector<uint32_t>& table)
    : layout_(layout) {
    nb_ = uint32_t((num_tokens + layout.tokens_per_block - 1) / layout.tokens_per_block);
    if (table.size() < nb_) throw std::runtime_error("ProactiveMirror: the block table is shorter than the request");
    table_.assign(table.begin(), table.begin() + nb_);
    sg_error_info_t err;
    sg_error_info_init(&err);
    check(sg_selector_create(profile, &layout_, num_tokens, &sel_, &err), "sg_selector_create (proactive set)", &err);
    size_t floats = 0;
    check(sg_selector_digest_floats(sel_, &floats), "sg_selector_digest_floats");
    digests_.resize(floats);
    out_.resize(nb_);
}

ProactiveMirror::~ProactiveMirror() {
    if (sel_) sg_selector_destroy(sel_);
}

const std::vector<uint32_t>& ProactiveMirror::select(uint32_t layer, const float* queries, uint32_t num_queries,
                                                     uint32_t num_q_heads) {
    const uint64_t t0 = now_ns();
    // The runtime's proactive path hands the selector both the layer's digests (quest) and its keys
    // (snapkv) whatever the policy (runtime/core/paths.cpp, prepare_layer); so does this copy.
    check(sg_selector_digest(sel_, &layout_, layer, table_.data(), table_.size(), digests_.data(), digests_.size()),
          "sg_selector_digest (proactive set)");
    sg_selector_input_t in;
    sg_selector_input_init(&in);
    in.queries = queries;
    in.num_queries = num_queries;
    in.num_q_heads = num_q_heads;
    in.digests = digests_.data();
    in.keys_layout = &layout_;
    in.block_ids = table_.data();
    in.num_block_ids = table_.size();
    out_.resize(nb_);
    size_t count = 0;
    check(sg_selector_select(sel_, layer, &in, out_.data(), out_.size(), &count), "sg_selector_select (proactive set)");
    out_.resize(count);
    ns += now_ns() - t0;
    return out_;
}

uint64_t ProactiveMirror::budget_blocks(uint32_t layer) const {
    uint64_t b = 0;
    check(sg_selector_budget_blocks(sel_, layer, &b), "sg_selector_budget_blocks");
    return b;
}

ProactiveSender::ProactiveSender(std::unique_ptr<ProactiveMirror> mirror, std::function<void(const std::string&)> send)
    : mirror_(std::move(mirror)), send_(std::move(send)), thread_([this] { run(); }) {}

ProactiveSender::~ProactiveSender() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void ProactiveSender::post(uint32_t layer, const float* queries, uint32_t num_queries, uint32_t num_q_heads,
                           size_t head_dim) {
    Job j{layer, num_queries, num_q_heads, {}};
    if (queries) j.queries.assign(queries, queries + size_t(num_queries) * num_q_heads * head_dim);
    {
        std::lock_guard lock(mu_);
        jobs_.push_back(std::move(j));
    }
    cv_.notify_all();
}

uint64_t ProactiveSender::finish() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return (jobs_.empty() && !busy_) || error_; });
    if (error_) std::rethrow_exception(error_);
    return mirror_->ns;
}

void ProactiveSender::run() {
    std::unique_lock lock(mu_);
    for (;;) {
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (stop_ || error_) return;
        Job j = std::move(jobs_.front());
        jobs_.pop_front();
        busy_ = true;
        lock.unlock();
        try {
            const std::vector<uint32_t>& P =
                mirror_->select(j.layer, j.queries.empty() ? nullptr : j.queries.data(), j.num_queries, j.num_q_heads);
            for (const std::string& m : encode_pset(j.layer, P, mirror_->num_blocks())) send_(m);
        } catch (...) {
            lock.lock();
            error_ = std::current_exception();
            busy_ = false;
            cv_.notify_all();
            return;
        }
        lock.lock();
        busy_ = false;
        cv_.notify_all();
    }
}

std::vector<std::string> encode_pset(uint32_t layer, const std::vector<uint32_t>& blocks, uint32_t num_blocks,
                                     size_t max_len) {
    const std::string head = "PSET layer=" + std::to_string(layer) + " blocks=" + std::to_string(num_blocks);
    // Room for " first=NNNNNNNNNN bits=" after the head; whole nibbles, at least one per message.
    const size_t fixed = head.size() + 24;
    if (max_len < fixed + 1) throw std::runtime_error("encode_pset: max_len too small");
    const size_t nibbles_per_msg = max_len - fixed;
    const size_t nibbles = (size_t(num_blocks) + 3) / 4;
    std::vector<uint8_t> nib(std::max<size_t>(nibbles, 1), 0);
    for (uint32_t b : blocks) {
        if (b >= num_blocks) throw std::runtime_error("encode_pset: block beyond the request");
        nib[b / 4] |= uint8_t(1u << (b % 4));
    }
    static const char kHex[] = "0123456789abcdef";
    std::vector<std::string> out;
    for (size_t j = 0; j < nib.size(); j += nibbles_per_msg) {
        std::string m = head + " first=" + std::to_string(j * 4) + " bits=";
        for (size_t k = j; k < std::min(nib.size(), j + nibbles_per_msg); ++k) m += kHex[nib[k]];
        out.push_back(std::move(m));
    }
    return out;
}

ProactiveSets::ProactiveSets(uint32_t layers, uint32_t num_blocks)
    : nb_(num_blocks), have_(layers, 0), bits_(layers, std::vector<uint8_t>(num_blocks, 0)) {}

void ProactiveSets::add(const std::string& body) {
    std::istringstream in(body);
    std::string kv, bits;
    long long layer = -1, blocks = -1, first = -1;
    bool has_bits = false;
    while (in >> kv) {
        const size_t eq = kv.find('=');
        if (eq == std::string::npos) bad_pset(body, "a field without '='");
        const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
        if (k == "bits") {
            bits = v;
            has_bits = true;
            continue;
        }
        char* end = nullptr;
        const long long x = std::strtoll(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || x < 0) bad_pset(body, "field " + k + " is not a count");
        if (k == "layer")
            layer = x;
        else if (k == "blocks")
            blocks = x;
        else if (k == "first")
            first = x;
    }
    if (layer < 0 || blocks < 0 || first < 0 || !has_bits) bad_pset(body, "a field is missing");
    if (uint64_t(layer) >= have_.size()) bad_pset(body, "layer out of range");
    if (uint64_t(blocks) != nb_) bad_pset(body, "the request has " + std::to_string(nb_) + " blocks");
    if (first % 4 != 0 || uint64_t(first) != have_[size_t(layer)]) bad_pset(body, "chunk out of order");
    std::vector<uint64_t> set;  // checked whole before anything changes
    for (size_t j = 0; j < bits.size(); ++j) {
        const char c = bits[j];
        const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) bad_pset(body, "bits is not lowercase hex");
        for (int i = 0; i < 4; ++i) {
            const uint64_t b = uint64_t(first) + 4 * j + uint64_t(i);
            if (!((v >> i) & 1)) continue;
            if (b >= nb_) bad_pset(body, "a block beyond the request");
            set.push_back(b);
        }
    }
    for (uint64_t b : set) bits_[size_t(layer)][b] = 1;
    have_[size_t(layer)] = std::min<uint64_t>(nb_, uint64_t(first) + 4 * bits.size());
}

std::vector<uint32_t> ProactiveSets::blocks(uint32_t layer) const {
    std::vector<uint32_t> out;
    for (uint32_t b = 0; b < nb_; ++b)
        if (bits_[layer][b]) out.push_back(b);
    return out;
}

}  // namespace sg::disagg
