// The C ABI: attention parts (merging partial softmax results).
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

// ---- attention parts ----
namespace {
// The shape both attention calls share; rows * head_dim cannot wrap (two uint32_t in a size_t).
void check_part_shape(uint32_t rows, uint32_t head_dim) {
    static_assert(sizeof(size_t) >= 8, "rows * head_dim must fit a size_t");
    if (!rows) fail(SG_ERR_INVALID_ARGUMENT, "rows is 0");
    if (!head_dim) fail(SG_ERR_INVALID_ARGUMENT, "head_dim is 0");
}

// A row of a part as merge_parts assumes it: a sum of exponentials (finite, >= 0), and a finite max
// whenever the sum says the row is not empty (exp(max - max) with an infinite max is NaN, which
// would spread into the merged row instead of being reported).
void check_part_row(const float *max, const float *sum, uint32_t r, const char *part) {
    if (!(sum[r] >= 0) || std::isinf(sum[r]))
        fail(SG_ERR_INVALID_ARGUMENT, std::string(part) + " row " + std::to_string(r) + ": sum " +
                                          std::to_string(sum[r]) + " is not a finite value >= 0");
    if (sum[r] > 0 && !std::isfinite(max[r]))
        fail(SG_ERR_INVALID_ARGUMENT, std::string(part) + " row " + std::to_string(r) + ": max " +
                                          std::to_string(max[r]) + " is not finite while sum is " +
                                          std::to_string(sum[r]));
}
// Whether the float merge of two valid rows would overflow: their sums (or accumulators) add past
// what a float holds. Decided in double, where the same sums cannot overflow.
constexpr double kMergeHeadroom = 0x1p120;  // below FLT_MAX (~2^128), with room for rounding
bool merge_overflows(float ma, float sa, const float *acc_a, float mb, float sb, const float *acc_b, uint32_t dim) {
    if (sa == 0 || sb == 0) return false;  // an empty side: the other is copied or kept
    const double m = std::max(ma, mb), ea = std::exp(double(ma) - m), eb = std::exp(double(mb) - m);
    if (double(sa) * ea + double(sb) * eb > kMergeHeadroom) return true;
    for (uint32_t i = 0; i < dim; ++i)
        if (std::fabs(double(acc_a[i]) * ea) + std::fabs(double(acc_b[i]) * eb) > kMergeHeadroom) return true;
    return false;
}

// The merge of such a row in double, rescaled into float range: a part stands for exp(max) * sum
// (and exp(max) * acc), so dividing sum and acc by 2^k and adding k ln 2 to max is the same part.
void merge_rescaled(float *max, float *sum, float *acc, float mb, float sb, const float *acc_b, uint32_t dim,
                    std::vector<double> &wide) {
    const double m = std::max(*max, mb), ea = std::exp(double(*max) - m), eb = std::exp(double(mb) - m);
    const double s = double(*sum) * ea + double(sb) * eb;
    wide.resize(dim);  // acc_b may be acc: read both before writing either
    double peak = s;
    for (uint32_t i = 0; i < dim; ++i) {
        wide[i] = double(acc[i]) * ea + double(acc_b[i]) * eb;
        peak = std::max(peak, std::fabs(wide[i]));
    }
    const int k = std::max(0, std::ilogb(peak) - 100);
    const double scale = std::ldexp(1.0, -k);
    *max = float(m + k * std::log(2.0));
    *sum = float(s * scale);
    for (uint32_t i = 0; i < dim; ++i) acc[i] = float(wide[i] * scale);
}
}  // namespace

SG_API sg_status_t sg_attention_merge(uint32_t rows, uint32_t head_dim, float *max, float *sum, float *acc,
                                      const float *max_b, const float *sum_b, const float *acc_b) {
    return guard(nullptr, [&] {
        need(max, "max");
        need(sum, "sum");
        need(acc, "acc");
        need(max_b, "max_b");
        need(sum_b, "sum_b");
        need(acc_b, "acc_b");
        check_part_shape(rows, head_dim);
        // Every row is checked before any is merged: outputs are written only on success.
        for (uint32_t r = 0; r < rows; ++r) {
            check_part_row(max, sum, r, "part a");
            check_part_row(max_b, sum_b, r, "part b");
        }
        std::vector<double> wide;
        for (uint32_t r = 0; r < rows; ++r) {
            const size_t off = size_t(r) * head_dim;
            if (!merge_overflows(max[r], sum[r], acc + off, max_b[r], sum_b[r], acc_b + off, head_dim)) {
                // b's max and sum go by value and acc is combined element by element, so b may be a.
                sg::kernels::merge_parts({max + r, sum + r, acc + off}, max_b[r], sum_b[r], acc_b + off, head_dim);
                continue;
            }
            merge_rescaled(max + r, sum + r, acc + off, max_b[r], sum_b[r], acc_b + off, head_dim, wide);
        }
        return SG_OK;
    });
}

SG_API sg_status_t sg_attention_finish(uint32_t rows, uint32_t head_dim, const float *sum, const float *acc,
                                       float *out) {
    return guard(nullptr, [&] {
        need(sum, "sum");
        need(acc, "acc");
        need(out, "out");
        check_part_shape(rows, head_dim);
        for (uint32_t r = 0; r < rows; ++r) {
            if (!(sum[r] >= 0) || std::isinf(sum[r]))
                fail(SG_ERR_INVALID_ARGUMENT,
                     "row " + std::to_string(r) + ": sum " + std::to_string(sum[r]) + " is not a finite value >= 0");
            // acc / sum of a real part is a weighted mean of values and stays in float range; one
            // that does not (acc far larger than sum: a tiny or subnormal sum) is refused, never Inf.
            if (sum[r] == 0) continue;
            const size_t off = size_t(r) * head_dim;
            for (uint32_t i = 0; i < head_dim; ++i)
                if (!(std::fabs(double(acc[off + i]) / double(sum[r])) <= double(FLT_MAX)))
                    fail(SG_ERR_OUT_OF_RANGE, "row " + std::to_string(r) + ": acc[" + std::to_string(i) + "] / sum = " +
                                                  std::to_string(acc[off + i]) + " / " + std::to_string(sum[r]) +
                                                  " is beyond float range (not a part: acc is at most sum * max |v|)");
        }
        for (uint32_t r = 0; r < rows; ++r) {
            const size_t off = size_t(r) * head_dim;
            if (sum[r] > 0 && !std::isfinite(1.0f / sum[r])) {
                // A sum so small its reciprocal is no float (the kernel multiplies by it): divide in
                // double; the checks above keep every quotient in float range.
                for (uint32_t i = 0; i < head_dim; ++i) out[off + i] = float(double(acc[off + i]) / double(sum[r]));
                continue;
            }
            sg::kernels::finish_part(sum[r], acc + off, head_dim, out + off);
        }
        return SG_OK;
    });
}

}  // extern "C"
