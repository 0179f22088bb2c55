// kernels/cpu: the instruction-set variants of the page digest and Quest kernels, for tests and
// benchmarks (not part of kernels.hpp). page_digest and quest_scores run best_isa(); these entry points
// run a named one, so a test can hold every variant the CPU has against the portable path.
#pragma once

#include "kernels.hpp"

namespace sg::kernels::cpu {

// Ordered: each needs what the one before it needs. avx2 = AVX2 + F16C + FMA; avx512 = that plus
// AVX-512 F/BW/VL.
enum class Isa : uint8_t { portable, avx2, avx512 };

const char *isa_name(Isa isa);
// Whether this CPU runs `isa` (portable always; the others only on x86-64).
bool isa_supported(Isa isa);
// The widest supported variant, asked of the CPU once.
Isa best_isa();

// page_digest and quest_scores on `isa`, which must be supported. A shape the variant does not
// handle (fp32 keys, dim not a multiple of its vector) runs the next narrower variant that does, as
// the public calls do: the digest is bit-identical on every variant; scores differ in summation order
// and rounding (FMA) only.
void page_digest_on(Isa isa, const View &keys, uint32_t tokens_per_block, float *out);
void quest_scores_on(Isa isa, const float *digest, uint64_t blocks, uint32_t kv_heads, const View &query,
                     Combine combine, float *out);

}  // namespace sg::kernels::cpu
