// Top-k with deterministic ties (kernels.hpp).
#include "cpu/cpu.hpp"

#include <cmath>
#include <limits>
#include <numeric>

namespace sg::kernels {

void top_k(std::span<const float> scores, std::span<uint32_t> candidates, size_t k) {
    k = std::min(k, candidates.size());
    if (k == 0) return;
    // A total order (score, then index) makes the result independent of the input order, so both
    // sides of a transfer that score the same data choose the same blocks. NaN would break the
    // strict weak ordering nth_element needs, so it ranks as -inf.
    const auto key = [&](uint32_t i) {
        const float s = scores[i];
        return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
    };
    const auto better = [&](uint32_t a, uint32_t b) {
        const float ka = key(a), kb = key(b);
        return ka > kb || (ka == kb && a < b);
    };
    if (k < candidates.size())
        std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), better);
    std::sort(candidates.begin(), candidates.begin() + k, better);
}

std::vector<uint32_t> top_k(std::span<const float> scores, size_t k) {
    std::vector<uint32_t> idx(scores.size());
    std::iota(idx.begin(), idx.end(), 0u);
    top_k(scores, idx, k);
    idx.resize(std::min(k, idx.size()));
    return idx;
}

}  // namespace sg::kernels
