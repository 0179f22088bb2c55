// Fuzzer: selection profiles in JSON (select::parse_profile, what sg_profile_parse and
// sg_profile_load run), their canonical form and a selector built from them.
//
// The input is the JSON text. A profile that parses must survive its own canonical form:
// parse_profile(to_json(p)) == p (select.hpp promises it), else the run aborts as a finding. A
// parsed profile then builds a Selector for a small request (token count and KV row size from the
// profile's own shape) and selects every layer with flat scores, as the proactive path would.
// sg::Error is a clean refusal.
#include "select/select.hpp"

#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>
#include <vector>

using namespace sg;

namespace {

// A selector holds a rule per (layer, KV head) and selection walks them: bounded so that a huge
// but valid shape costs time in parse_profile only.
constexpr uint64_t kMaxSelectorStreams = 1u << 14;

void select_all(const select::Profile &p) {
    if (uint64_t(p.num_layers) * p.num_kv_heads > kMaxSelectorStreams) return;
    select::Request req;
    req.num_tokens = uint64_t(p.block_tokens) * 9 + 3;  // a partial last block
    req.head_token_bytes = 2 * 64 * 2;                  // fp16, head_dim 64
    try {
        const select::Selector sel(p, req);
        std::vector<float> scores(size_t(sel.num_blocks()) * sel.num_kv_heads(), 1.0f);
        select::LayerSelection out;
        for (uint32_t l = 0; l < sel.num_layers(); ++l) {
            sel.select_layer(l, sel.needs_scores(l) ? std::span<const float>(scores) : std::span<const float>(), out);
            for (size_t i = 1; i < out.blocks.size(); ++i)
                if (out.blocks[i - 1] >= out.blocks[i] || out.blocks[i] >= sel.num_blocks()) {
                    std::fprintf(stderr, "fuzz_profile: layer %u's essential blocks are not ascending and in range\n", l);
                    std::abort();
                }
        }
    } catch (const Error &) {
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string_view json(reinterpret_cast<const char *>(data), size);
    select::Profile p;
    try {
        p = select::parse_profile(json);
    } catch (const Error &) {
        return 0;
    }
    std::string canonical;
    try {
        canonical = select::to_json(p);
        if (!(select::parse_profile(canonical) == p)) throw Error(SG_ERR_INTERNAL, "differs");
    } catch (const Error &e) {
        std::fprintf(stderr, "fuzz_profile: the canonical form of a parsed profile does not parse back to it (%s):\n%s\n",
                     e.message().c_str(), canonical.c_str());
        std::abort();
    }
    select_all(p);
    return 0;
}
