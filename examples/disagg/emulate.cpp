// examples/disagg/emulate.cpp: see emulate.hpp.
#include "emulate.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine.hpp"

namespace sg::disagg {

namespace {

const EmuShape kShapes[] = {
    // name         layers dim   hidden n_heads kv  head_dim vocab
    {"llama3-8b", 32, 4096, 14336, 32, 8, 128, 128256},
    {"qwen3-8b", 36, 4096, 12288, 32, 8, 128, 151936},
    {"llama3-70b", 80, 8192, 28672, 64, 8, 128, 128256},
};

uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [-1, 1).
float unit_uniform(uint64_t& s) { return float(double(splitmix(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0); }

std::vector<float> random_unit(uint64_t& s, int d) {
    std::vector<float> v(static_cast<size_t>(d));
    double n = 0;
    for (float& x : v) {
        x = unit_uniform(s);
        n += double(x) * x;
    }
    for (float& x : v) x = float(x / std::sqrt(n));
    return v;
}

}  // namespace

const EmuShape* find_emu_shape(const std::string& name) {
    for (const EmuShape& s : kShapes)
        if (name == s.name) return &s;
    return nullptr;
}

SyntheticKeys::SyntheticKeys(const EmuShape& shape, uint64_t n_tokens, int block_tokens, int patterns, double mass,
                             double overlap, uint64_t seed)
    : shape_(shape), n_(n_tokens), B_(block_tokens), patterns_(std::max(1, patterns)), seed_(seed) {
    nb_ = uint32_t((n_ + uint64_t(B_) - 1) / uint64_t(B_));
    n_hot_ = std::max<uint32_t>(1, (nb_ + 7) / 8);
    const double cold = double(nb_ - n_hot_);
    alpha_ = cold > 0 ? std::sqrt(double(shape_.head_dim)) * std::log(mass / (1.0 - mass) * cold / n_hot_) : 0.0;
    if (alpha_ < 0) alpha_ = 0;
    const int d = shape_.head_dim;
    for (int p = 0; p < patterns_; ++p) {
        uint64_t s = seed_ * 1000003ull + uint64_t(p) * 7919ull + 1;
        std::vector<float> u = random_unit(s, d), w = random_unit(s, d);
        // w orthogonal to u (Gram-Schmidt), then unit length.
        double dot = 0, n = 0;
        for (int i = 0; i < d; ++i) dot += double(u[size_t(i)]) * w[size_t(i)];
        for (int i = 0; i < d; ++i) {
            w[size_t(i)] = float(w[size_t(i)] - dot * u[size_t(i)]);
            n += double(w[size_t(i)]) * w[size_t(i)];
        }
        for (float& x : w) x = float(x / std::sqrt(n));
        u_.push_back(std::move(u));
        w_.push_back(std::move(w));

        // Hot sets: a seeded shuffle of the blocks; the first n_hot are H_pre, H_dec keeps
        // round(overlap * n_hot) of them and takes the rest from the blocks after them.
        std::vector<uint32_t> order(nb_);
        std::iota(order.begin(), order.end(), 0u);
        for (uint32_t i = nb_; i > 1; --i) std::swap(order[i - 1], order[size_t(splitmix(s) % i)]);
        std::vector<uint8_t> pre(nb_, 0), dec(nb_, 0);
        const uint32_t keep = std::min(n_hot_, uint32_t(std::lround(overlap * n_hot_)));
        for (uint32_t i = 0; i < n_hot_; ++i) pre[order[i]] = 1;
        for (uint32_t i = 0; i < keep; ++i) dec[order[i]] = 1;
        for (uint32_t i = 0; i < n_hot_ - keep && n_hot_ + i < nb_; ++i) dec[order[n_hot_ + i]] = 1;
        hot_pre_.push_back(std::move(pre));
        hot_dec_.push_back(std::move(dec));
    }
}

void SyntheticKeys::fill_keys(int p, uint16_t* region) const {
    const int d = shape_.head_dim, H = shape_.n_kv_heads;
    const float noise = float(sigma_ * std::sqrt(3.0));  // uniform [-a, a) has std a / sqrt(3)
    const std::vector<float>&u = u_[size_t(p)], &w = w_[size_t(p)];
    std::vector<float> base(static_cast<size_t>(d));
    uint64_t s = seed_ * 0x2545F4914F6CDD1Dull + uint64_t(p) + 17;
    for (uint64_t t = 0; t < n_; ++t) {
        const uint32_t b = uint32_t(t / uint64_t(B_));
        const float a_u = hot_pre_[size_t(p)][b] ? float(alpha_) : 0.0f;
        const float a_w = hot_dec_[size_t(p)][b] ? float(alpha_) : 0.0f;
        for (int i = 0; i < d; ++i) base[size_t(i)] = a_u * u[size_t(i)] + a_w * w[size_t(i)];
        uint16_t* row = region + t * uint64_t(H) * uint64_t(d);  // packed token-major: block b slot t%B
        for (int h = 0; h < H; ++h)
            for (int i = 0; i < d; ++i)
                row[size_t(h) * d + size_t(i)] = f32_to_f16(base[size_t(i)] + noise * unit_uniform(s));
    }
}

void SyntheticKeys::prefill_queries(int p, int window, float* out) const {
    const int d = shape_.head_dim;
    for (int r = 0; r < window; ++r)
        for (int h = 0; h < shape_.n_heads; ++h)
            std::copy(u_[size_t(p)].begin(), u_[size_t(p)].end(), out + (size_t(r) * shape_.n_heads + h) * d);
}

void SyntheticKeys::decode_query(int p, uint64_t step, float* out) const {
    const int d = shape_.head_dim;
    uint64_t s = seed_ * 0x9E3779B97F4A7C15ull + step * 131ull + uint64_t(p) * 7ull + 5;
    const std::vector<float> e = random_unit(s, d);
    std::vector<float> q(static_cast<size_t>(d));
    double n = 0;
    for (int i = 0; i < d; ++i) {
        q[size_t(i)] = w_[size_t(p)][size_t(i)] + 0.1f * e[size_t(i)];
        n += double(q[size_t(i)]) * q[size_t(i)];
    }
    for (float& x : q) x = float(x / std::sqrt(n));
    for (int h = 0; h < shape_.n_heads; ++h) std::copy(q.begin(), q.end(), out + size_t(h) * d);
}

double SyntheticKeys::measured_mass(int p, const uint16_t* region) const {
    const int d = shape_.head_dim, H = shape_.n_kv_heads;
    const std::vector<float>& q = u_[size_t(p)];
    std::vector<double> score(n_);
    double mx = -1e300;
    for (uint64_t t = 0; t < n_; ++t) {
        const uint16_t* k = region + t * uint64_t(H) * uint64_t(d);  // KV head 0
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += double(q[size_t(i)]) * f16_to_f32(k[i]);
        score[t] = dot / std::sqrt(double(d));
        mx = std::max(mx, score[t]);
    }
    std::vector<double> block_mass(nb_, 0.0);
    double total = 0;
    for (uint64_t t = 0; t < n_; ++t) {
        const double e = std::exp(score[t] - mx);
        block_mass[t / uint64_t(B_)] += e;
        total += e;
    }
    std::sort(block_mass.begin(), block_mass.end(), std::greater<double>());
    double top = 0;
    for (uint32_t i = 0; i < n_hot_; ++i) top += block_mass[i];
    return top / total;
}

}  // namespace sg::disagg
