// Attention parts through the public C API (sg_attention_merge / sg_attention_finish): random splits
// of random keys merge to the unsplit softmax attention computed in double; an empty part changes
// nothing, bit for bit; aliasing as the header allows it; and every hostile argument is refused
// with SG_ERR_INVALID_ARGUMENT, a message that names it, and the outputs untouched.
#include <gtest/gtest.h>
#include <smartgen/smartgen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One part's arrays for `rows` query rows of `dim` floats, empty to start with.
struct Part {
    std::vector<float> max, sum, acc;
    Part(uint32_t rows, uint32_t dim) : max(rows, -kInf), sum(rows, 0.0f), acc(size_t(rows) * dim, 0.0f) {}
    bool same_bits(const Part &o) const {
        return std::memcmp(max.data(), o.max.data(), max.size() * 4) == 0 &&
               std::memcmp(sum.data(), o.sum.data(), sum.size() * 4) == 0 &&
               std::memcmp(acc.data(), o.acc.data(), acc.size() * 4) == 0;
    }
};

sg_status_t merge(Part &a, const Part &b, uint32_t rows, uint32_t dim) {
    return sg_attention_merge(rows, dim, a.max.data(), a.sum.data(), a.acc.data(), b.max.data(), b.sum.data(),
                              b.acc.data());
}

// Keys given by their scores (per row) and values (per key, shared by the rows as a KV head is).
struct Problem {
    uint32_t rows, dim, keys;
    std::vector<float> scores;  // [row][key]
    std::vector<float> values;  // [key][dim]
};

Problem random_problem(std::mt19937 &rng, uint32_t rows, uint32_t dim, uint32_t keys, float spread) {
    Problem p{rows, dim, keys, std::vector<float>(size_t(rows) * keys), std::vector<float>(size_t(keys) * dim)};
    std::uniform_real_distribution<float> s(-spread, spread), v(-4.0f, 4.0f);
    for (float &x : p.scores) x = s(rng);
    for (float &x : p.values) x = v(rng);
    return p;
}

// The part over the keys `which`, built as an engine builds it (two passes: max, then the sums).
Part part_of(const Problem &p, const std::vector<uint32_t> &which) {
    Part out(p.rows, p.dim);
    for (uint32_t r = 0; r < p.rows; ++r) {
        for (uint32_t j : which) out.max[r] = std::max(out.max[r], p.scores[size_t(r) * p.keys + j]);
        for (uint32_t j : which) {
            const float w = std::exp(p.scores[size_t(r) * p.keys + j] - out.max[r]);
            out.sum[r] += w;
            for (uint32_t i = 0; i < p.dim; ++i) out.acc[size_t(r) * p.dim + i] += w * p.values[size_t(j) * p.dim + i];
        }
    }
    return out;
}

// softmax(scores) . values per row, in double.
std::vector<double> reference(const Problem &p) {
    std::vector<double> out(size_t(p.rows) * p.dim, 0.0);
    for (uint32_t r = 0; r < p.rows; ++r) {
        double m = -INFINITY, sum = 0;
        for (uint32_t j = 0; j < p.keys; ++j) m = std::max(m, double(p.scores[size_t(r) * p.keys + j]));
        for (uint32_t j = 0; j < p.keys; ++j) sum += std::exp(double(p.scores[size_t(r) * p.keys + j]) - m);
        for (uint32_t j = 0; j < p.keys; ++j) {
            const double w = std::exp(double(p.scores[size_t(r) * p.keys + j]) - m) / sum;
            for (uint32_t i = 0; i < p.dim; ++i) out[size_t(r) * p.dim + i] += w * p.values[size_t(j) * p.dim + i];
        }
    }
    return out;
}

// 300 random problems (1-8 rows, dims 1..128, 1-300 keys, score spreads up to +-500), each split at
// random into 1-6 parts (empty ones included) and merged in a random order: the finished rows equal
// the unsplit attention within 2e-5 x (1 + max|v|) (|v| <= 4: relative float rounding of sums of
// a few hundred terms).
TEST(AttentionApi, RandomSplitsMergeToTheUnsplitAttention) {
    std::mt19937 rng(20261201);
    const uint32_t dims[] = {1, 3, 16, 64, 128};
    const float spreads[] = {1.0f, 20.0f, 500.0f};
    double worst = 0;
    for (int trial = 0; trial < 300; ++trial) {
        const uint32_t rows = 1 + rng() % 8, dim = dims[rng() % 5], keys = 1 + rng() % 300;
        const Problem p = random_problem(rng, rows, dim, keys, spreads[rng() % 3]);
        const uint32_t nparts = 1 + rng() % 6;
        std::vector<std::vector<uint32_t>> split(nparts);
        for (uint32_t j = 0; j < keys; ++j) split[rng() % nparts].push_back(j);
        if (trial % 7 == 0) split.emplace_back();  // an explicit empty part too
        std::shuffle(split.begin(), split.end(), rng);

        Part acc(rows, dim);  // starts empty: the first merge copies
        for (const auto &which : split)
            ASSERT_EQ(merge(acc, part_of(p, which), rows, dim), SG_OK) << sg_last_error_message();
        std::vector<float> out(size_t(rows) * dim, kNaN);
        ASSERT_EQ(sg_attention_finish(rows, dim, acc.sum.data(), acc.acc.data(), out.data()), SG_OK);
        const std::vector<double> want = reference(p);
        for (size_t i = 0; i < out.size(); ++i) {
            worst = std::max(worst, std::fabs(out[i] - want[i]));
            ASSERT_NEAR(out[i], want[i], 2e-5 * (1 + 4)) << "trial " << trial << " element " << i;
        }
    }
    std::printf("largest difference from the double reference: %.3g\n", worst);
}

TEST(AttentionApi, AnEmptyPartChangesNothing) {
    std::mt19937 rng(7);
    const uint32_t rows = 4, dim = 32;
    const Problem p = random_problem(rng, rows, dim, 50, 10.0f);
    std::vector<uint32_t> all(50);
    for (uint32_t j = 0; j < 50; ++j) all[j] = j;
    const Part a = part_of(p, all), empty(rows, dim);

    Part x = a;
    ASSERT_EQ(merge(x, empty, rows, dim), SG_OK);
    EXPECT_TRUE(x.same_bits(a)) << "merging an empty part into a changed a";
    Part y = empty;
    ASSERT_EQ(merge(y, a, rows, dim), SG_OK);
    EXPECT_TRUE(y.same_bits(a)) << "merging a into an empty part is not a copy";
    Part z = empty;
    ASSERT_EQ(merge(z, empty, rows, dim), SG_OK);
    EXPECT_TRUE(z.same_bits(empty));
    // Any row with sum 0 is empty, whatever its max says (a stale max from a reused buffer).
    Part stale = empty;
    std::fill(stale.max.begin(), stale.max.end(), 3.0f);
    x = a;
    ASSERT_EQ(merge(x, stale, rows, dim), SG_OK);
    EXPECT_TRUE(x.same_bits(a));

    // An empty row finishes to zeros; the others to acc / sum.
    Part mixed = a;
    mixed.max[1] = -kInf, mixed.sum[1] = 0;
    std::fill(mixed.acc.begin() + dim, mixed.acc.begin() + 2 * dim, 0.0f);
    std::vector<float> out(size_t(rows) * dim, kNaN);
    ASSERT_EQ(sg_attention_finish(rows, dim, mixed.sum.data(), mixed.acc.data(), out.data()), SG_OK);
    for (uint32_t i = 0; i < dim; ++i) EXPECT_EQ(out[dim + i], 0.0f);
    EXPECT_FLOAT_EQ(out[0], a.acc[0] / a.sum[0]);
}

TEST(AttentionApi, AliasingAsTheHeaderAllows) {
    std::mt19937 rng(11);
    const uint32_t rows = 3, dim = 16;
    const Problem p = random_problem(rng, rows, dim, 40, 30.0f);
    std::vector<uint32_t> all(40);
    for (uint32_t j = 0; j < 40; ++j) all[j] = j;
    const Part a = part_of(p, all);
    std::vector<float> once(size_t(rows) * dim), twice(once.size());
    ASSERT_EQ(sg_attention_finish(rows, dim, a.sum.data(), a.acc.data(), once.data()), SG_OK);
    // b = a: every key counts twice, which leaves the attention as it was (doubling is exact).
    Part x = a;
    ASSERT_EQ(sg_attention_merge(rows, dim, x.max.data(), x.sum.data(), x.acc.data(), x.max.data(), x.sum.data(),
                                 x.acc.data()),
              SG_OK);
    for (uint32_t r = 0; r < rows; ++r) EXPECT_EQ(x.sum[r], 2 * a.sum[r]);
    ASSERT_EQ(sg_attention_finish(rows, dim, x.sum.data(), x.acc.data(), twice.data()), SG_OK);
    EXPECT_EQ(std::memcmp(once.data(), twice.data(), once.size() * 4), 0);
    // out = acc, in place.
    ASSERT_EQ(sg_attention_finish(rows, dim, x.sum.data(), x.acc.data(), x.acc.data()), SG_OK);
    EXPECT_EQ(std::memcmp(once.data(), x.acc.data(), once.size() * 4), 0);
}

// Each bad argument: SG_ERR_INVALID_ARGUMENT, the message names it, and no output changed.
TEST(AttentionApi, HostileArgumentsAreRefusedAndWriteNothing) {
    std::mt19937 rng(13);
    const uint32_t rows = 4, dim = 8;
    const Problem p = random_problem(rng, rows, dim, 20, 5.0f);
    std::vector<uint32_t> lo, hi;
    for (uint32_t j = 0; j < 20; ++j) (j < 10 ? lo : hi).push_back(j);
    const Part a0 = part_of(p, lo), b0 = part_of(p, hi);

    auto refused = [&](const char *what, const Part &a_in, const Part &b_in, const char *names, uint32_t r,
                       uint32_t d, int null_arg) {
        SCOPED_TRACE(what);
        Part a = a_in;
        const Part b = b_in;
        float *ap[3] = {a.max.data(), a.sum.data(), a.acc.data()};
        const float *bp[3] = {b.max.data(), b.sum.data(), b.acc.data()};
        if (null_arg >= 0 && null_arg < 3) ap[null_arg] = nullptr;
        if (null_arg >= 3) bp[null_arg - 3] = nullptr;
        EXPECT_EQ(sg_attention_merge(r, d, ap[0], ap[1], ap[2], bp[0], bp[1], bp[2]), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(sg_last_error_message()).find(names), std::string::npos) << sg_last_error_message();
        EXPECT_TRUE(a.same_bits(a_in)) << "part a was written by a refused call";
    };
    const char *arg_names[6] = {"max", "sum", "acc", "max_b", "sum_b", "acc_b"};
    for (int i = 0; i < 6; ++i) refused(arg_names[i], a0, b0, arg_names[i], rows, dim, i);
    refused("rows 0", a0, b0, "rows", 0, dim, -1);
    refused("head_dim 0", a0, b0, "head_dim", rows, 0, -1);

    // Rows that are not parts, in a, in b, and in the last row only (checked before the first is merged).
    struct Bad {
        const char *what;
        bool in_b;
        uint32_t row;
        float max, sum;
        const char *names;
    } bads[] = {
        {"negative sum", false, 0, 1.0f, -1.0f, "part a row 0: sum"},
        {"NaN sum", true, 2, 1.0f, kNaN, "part b row 2: sum"},
        {"infinite sum", false, 3, 1.0f, kInf, "part a row 3: sum"},
        {"NaN max with a sum", true, 3, kNaN, 2.0f, "part b row 3: max"},
        {"-inf max with a sum", false, 1, -kInf, 2.0f, "part a row 1: max"},
        {"+inf max with a sum", true, 3, kInf, 2.0f, "part b row 3: max"},
    };
    for (const Bad &bad : bads) {
        Part a = a0, b = b0;
        Part &t = bad.in_b ? b : a;
        t.max[bad.row] = bad.max;
        t.sum[bad.row] = bad.sum;
        refused(bad.what, a, b, bad.names, rows, dim, -1);
    }
    // A NaN max on an empty row is still an empty row.
    {
        Part a = a0, b = b0;
        b.max[1] = kNaN, b.sum[1] = 0;
        std::fill(b.acc.begin() + dim, b.acc.begin() + 2 * dim, 0.0f);
        ASSERT_EQ(merge(a, b, rows, dim), SG_OK);
        EXPECT_EQ(std::memcmp(a.acc.data() + dim, a0.acc.data() + dim, dim * 4), 0);
    }

    // sg_attention_finish.
    std::vector<float> out(size_t(rows) * dim, 42.0f);
    const std::vector<float> untouched = out;
    EXPECT_EQ(sg_attention_finish(rows, dim, nullptr, a0.acc.data(), out.data()), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_attention_finish(rows, dim, a0.sum.data(), nullptr, out.data()), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_attention_finish(rows, dim, a0.sum.data(), a0.acc.data(), nullptr), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(sg_last_error_message()).find("out"), std::string::npos);
    EXPECT_EQ(sg_attention_finish(0, dim, a0.sum.data(), a0.acc.data(), out.data()), SG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(sg_attention_finish(rows, 0, a0.sum.data(), a0.acc.data(), out.data()), SG_ERR_INVALID_ARGUMENT);
    for (float s : {-1.0f, kNaN, kInf}) {
        std::vector<float> sum = a0.sum;
        sum[rows - 1] = s;
        EXPECT_EQ(sg_attention_finish(rows, dim, sum.data(), a0.acc.data(), out.data()), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(sg_last_error_message()).find("row 3"), std::string::npos) << sg_last_error_message();
    }
    EXPECT_EQ(std::memcmp(out.data(), untouched.data(), out.size() * 4), 0) << "out was written by a refused call";
}

}  // namespace

namespace {
// Two valid parts whose sums add past FLT_MAX (each 3e38 with the same max): 0.4 answered SG_OK with
// sum +Inf, which finish then refused. Now the merged row is rescaled and finishes to the weighted
// mean of the two parts' outputs.
TEST(AttentionApi, SumsThatAddPastFloatRangeAreRescaledNotInfinite) {
    const uint32_t dim = 4;
    Part a(1, dim), b(1, dim);
    a.max[0] = b.max[0] = 2.0f;
    a.sum[0] = 3e38f;
    b.sum[0] = 3e38f;
    for (uint32_t i = 0; i < dim; ++i) {
        a.acc[i] = 3e38f * 1.0f;   // output 1.0 on its own
        b.acc[i] = -3e38f * 0.5f;  // output -0.5 on its own
    }
    ASSERT_EQ(merge(a, b, 1, dim), SG_OK) << sg_last_error_message();
    EXPECT_TRUE(std::isfinite(a.sum[0]) && a.sum[0] > 0) << a.sum[0];
    EXPECT_TRUE(std::isfinite(a.max[0]) && a.max[0] > 2.0f) << "the scale moves into max: " << a.max[0];
    // exp(max) * sum is the merged part: 6e38 * e^2, in the log domain.
    EXPECT_NEAR(std::log(double(a.sum[0])) + a.max[0], std::log(6e38) + 2.0, 1e-5);
    std::vector<float> out(dim);
    ASSERT_EQ(sg_attention_finish(1, dim, a.sum.data(), a.acc.data(), out.data()), SG_OK) << sg_last_error_message();
    for (float x : out) EXPECT_NEAR(x, 0.25f, 1e-6f);  // (1.0 - 0.5) / 2
    // Merging a third such part into the rescaled one keeps going.
    Part c(1, dim);
    c.max[0] = 2.0f;
    c.sum[0] = 3e38f;
    for (uint32_t i = 0; i < dim; ++i) c.acc[i] = 3e38f * 0.25f;
    ASSERT_EQ(merge(a, c, 1, dim), SG_OK);
    ASSERT_EQ(sg_attention_finish(1, dim, a.sum.data(), a.acc.data(), out.data()), SG_OK);
    for (float x : out) EXPECT_NEAR(x, 0.25f, 1e-6f);  // (1.0 - 0.5 + 0.25) / 3
}

// A subnormal sum under a normal acc is not a part: 0.4 gave SG_OK with +Inf outputs.
TEST(AttentionApi, AnOutputBeyondFloatRangeIsRefusedNotInfinite) {
    const float sum[2] = {1.0f, 1e-45f};
    const float acc[2] = {0.5f, 1.0f};
    float out[2] = {7.0f, 7.0f};
    EXPECT_EQ(sg_attention_finish(2, 1, sum, acc, out), SG_ERR_OUT_OF_RANGE);
    EXPECT_NE(std::string(sg_last_error_message()).find("row 1"), std::string::npos) << sg_last_error_message();
    EXPECT_EQ(out[0], 7.0f) << "out is untouched when any row is refused";
    // A subnormal sum with a proportionate acc is a part, and finishes.
    const float tiny_sum[2] = {1.0f, 1e-40f}, tiny_acc[2] = {0.5f, 0.5e-40f};
    EXPECT_EQ(sg_attention_finish(2, 1, tiny_sum, tiny_acc, out), SG_OK);
    EXPECT_NEAR(out[1], 0.5f, 1e-3f);
    EXPECT_TRUE(std::isfinite(out[1]));
}
}  // namespace
