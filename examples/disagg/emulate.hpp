// examples/disagg/emulate: what smartgen-disagg --emulate needs besides SmartGen itself: the shapes of
// the emulated models, the compute-time model, and the generator of synthetic keys and queries.
// Nothing here touches SmartGen.
//
// Compute-time model (an accelerator stated by two rates, printed with every emulated run):
//   prefill, per layer:  t = (2 * params_per_layer * N + 2 * n_heads * head_dim * N^2) / R_prefill
//                        (2 FLOP per weight per token for the projections and the FFN; causal attention
//                        costs QK^T + AV = 2 * 2 * n_heads * head_dim * N^2 / 2 FLOP)
//   decode, per step:    t = (2 * (params_per_layer * layers + vocab * dim)
//                             + sum over layers of attended_tokens * 2 * n_kv_heads * head_dim * 2) / BW
//                        (fp16 weights and K+V read once per step) + the measured selector time
// params_per_layer = dim * (n_heads * head_dim) * 2 (Q, O) + dim * (n_kv_heads * head_dim) * 2 (K, V)
//                  + 3 * dim * hidden (SwiGLU FFN) + 2 * dim (norms).
//
// Synthetic keys (per KV head, fp16, token-major blocks like the real pool), for a prompt of N tokens
// in nb blocks of B tokens. Layer l uses key pattern p = l mod R (R patterns fit the memory bound; the
// pool's layers share R K regions and one V region cyclically). Pattern p has two orthogonal unit
// directions u_p and w_p in R^head_dim and two hot sets of n_hot = ceil(nb / 8) blocks:
//   H_pre: chosen at random (seeded);
//   H_dec: round(overlap * n_hot) blocks of H_pre plus the rest chosen among the other blocks.
//   key(token in block b) = alpha * ([b in H_pre] u_p + [b in H_dec] w_p) + noise,
//   noise uniform with standard deviation sigma = 0.25 per element.
// Prefill's queries (the last W prompt positions, every query head) are beta * u_p with beta = 1; the
// query of decode step s is beta * normalize(w_p + 0.1 * e_s) with e_s a fresh random unit vector.
// alpha = sqrt(head_dim) * ln(mass / (1 - mass) * (nb - n_hot) / n_hot) makes the attention of a
// prefill query put `mass` of its softmax on H_pre (noise aside: measured_mass() reports the real
// figure), and decode's queries put the same mass on H_dec, whose overlap with H_pre is `overlap`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sg::disagg {

struct EmuShape {
    const char* name;
    int layers, dim, hidden, n_heads, n_kv_heads, head_dim, vocab;

    double params_per_layer() const {
        return double(dim) * n_heads * head_dim * 2 + double(dim) * n_kv_heads * head_dim * 2 + 3.0 * dim * hidden +
               2.0 * dim;
    }
    double kv_bytes_per_token_layer() const { return 2.0 * n_kv_heads * head_dim * 2; }  // K + V, fp16
};

// nullptr for an unknown name.
const EmuShape* find_emu_shape(const std::string& name);

struct ComputeModel {
    double prefill_flops = 400e12;  // FLOP/s
    double decode_bw = 4.8e12;      // B/s

    double prefill_layer_s(const EmuShape& s, uint64_t n) const {
        const double N = double(n);
        return (2.0 * s.params_per_layer() * N + 2.0 * s.n_heads * s.head_dim * N * N) / prefill_flops;
    }
    double decode_layer_s(const EmuShape& s, uint64_t attended_tokens) const {
        return (2.0 * s.params_per_layer() + double(attended_tokens) * s.kv_bytes_per_token_layer()) / decode_bw;
    }
    double decode_classifier_s(const EmuShape& s) const { return 2.0 * double(s.vocab) * s.dim / decode_bw; }
};

class SyntheticKeys {
  public:
    SyntheticKeys(const EmuShape& shape, uint64_t n_tokens, int block_tokens, int patterns, double mass, double overlap,
                  uint64_t seed);

    int patterns() const { return patterns_; }
    int pattern_of(int layer) const { return layer % patterns_; }
    uint32_t blocks() const { return nb_; }
    uint32_t hot_blocks() const { return n_hot_; }
    double alpha() const { return alpha_; }
    double sigma() const { return sigma_; }

    // Keys of pattern p into a token-major fp16 K region ([block][token][kv_head][head_dim], packed),
    // covering n_tokens (slots past it are left as they are).
    void fill_keys(int p, uint16_t* region) const;
    // Prefill's last `window` queries: [window][n_heads][head_dim].
    void prefill_queries(int p, int window, float* out) const;
    // Decode step `step`'s query: [n_heads][head_dim].
    void decode_query(int p, uint64_t step, float* out) const;
    // Attention mass that prefill's query puts on the top 1/8 of blocks (by mass), for pattern p and
    // KV head 0, computed on the fp16 keys of `region`.
    double measured_mass(int p, const uint16_t* region) const;
    bool hot_pre(int p, uint32_t block) const { return hot_pre_[size_t(p)][block] != 0; }

  private:
    EmuShape shape_;
    uint64_t n_;
    int B_;
    uint32_t nb_, n_hot_;
    int patterns_;
    uint64_t seed_;
    double alpha_, sigma_ = 0.25;
    std::vector<std::vector<float>> u_, w_;                // [p][head_dim]
    std::vector<std::vector<uint8_t>> hot_pre_, hot_dec_;  // [p][block]
};

}  // namespace sg::disagg
