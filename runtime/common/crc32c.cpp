// CRC32C (Castagnoli, the iSCSI/ext4 polynomial, reflected 0x82F63B78), zlib-style: the value of
// one range is the seed of the next. x86-64 CPUs with SSE4.2 (every Xeon and EPYC a server runs)
// compute it with the crc32 instruction, 8 bytes at a time; others use slicing-by-8 tables. The
// choice is made once, at first use, from what the CPU reports, never from how this was built.
//
// crc32c_copy checks a copy the runtime makes anyway (a staged chunk's pack and unpack): memcpy,
// then the CRC of the destination while it is in cache, so what is checked is what was stored.
// (A loop that loaded each word once for both ran at the CRC's single-stream speed and cost the
// staged path a fifth of its throughput; memcpy plus three streams costs far less.)
#include "common/common.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace sg {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
    Tables t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
        t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
        for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    return t;
}
constexpr Tables kTables = make_tables();

uint64_t load64(const uint8_t *p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

uint32_t step64_table(uint32_t c, uint64_t v) {
    // Little-endian: the low byte is the first one in memory.
    v ^= c;
    return kTables[7][v & 0xff] ^ kTables[6][(v >> 8) & 0xff] ^ kTables[5][(v >> 16) & 0xff] ^
           kTables[4][(v >> 24) & 0xff] ^ kTables[3][(v >> 32) & 0xff] ^ kTables[2][(v >> 40) & 0xff] ^
           kTables[1][(v >> 48) & 0xff] ^ kTables[0][v >> 56];
}

uint32_t step8_table(uint32_t c, uint8_t b) { return (c >> 8) ^ kTables[0][(c ^ b) & 0xff]; }

uint32_t run_table(uint32_t c, const uint8_t *src, size_t n) {
    for (; n >= 8; n -= 8, src += 8) c = step64_table(c, load64(src));
    for (; n; --n, ++src) c = step8_table(c, *src);
    return c;
}

// Multiplication modulo the polynomial in the reflected representation (bit 31 is x^0), as zlib
// combines CRCs: a CRC register advanced over n zero bytes is the register times x^(8n).
uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) product ^= b;
        b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;
    }
    return product;
}

// x^(8n) mod P.
uint32_t x_pow_8n(uint64_t n) {
    uint32_t result = 1u << 31;  // x^0
    uint32_t square = 1u << 23;  // x^8
    for (; n; n >>= 1) {
        if (n & 1) result = multiply_mod_p(square, result);
        square = multiply_mod_p(square, square);
    }
    return result;
}

// Multiplication of a register by one constant, as four byte tables: what moving a stream's CRC
// past the kStripe bytes of the streams after it costs, a few loads instead of 32 steps.
struct Shifter {
    uint32_t table[4][256];
    explicit Shifter(uint64_t bytes) {
        const uint32_t k = x_pow_8n(bytes);
        for (uint32_t i = 0; i < 4; ++i)
            for (uint32_t b = 0; b < 256; ++b) table[i][b] = multiply_mod_p(k, b << (8 * i));
    }
    uint32_t operator()(uint32_t c) const {
        return table[0][c & 0xff] ^ table[1][(c >> 8) & 0xff] ^ table[2][(c >> 16) & 0xff] ^ table[3][c >> 24];
    }
};

#if defined(__x86_64__)
// Three streams over three adjacent stripes hide the instruction's 3-cycle latency (one stream
// does 8 bytes per latency, three do 8 per cycle); the first two are then moved past the stripes
// after them and folded in, which CRC's linearity allows.
constexpr size_t kStripe = 1024;

__attribute__((target("sse4.2"))) uint32_t run_sse42(uint32_t c32, const uint8_t *src, size_t n) {
    static const Shifter one(kStripe), two(2 * kStripe);
    uint64_t c = c32;
    for (; n >= 3 * kStripe; n -= 3 * kStripe, src += 3 * kStripe) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < kStripe; i += 8) {
            c = _mm_crc32_u64(c, load64(src + i));
            c1 = _mm_crc32_u64(c1, load64(src + kStripe + i));
            c2 = _mm_crc32_u64(c2, load64(src + 2 * kStripe + i));
        }
        c = two(uint32_t(c)) ^ one(uint32_t(c1)) ^ uint32_t(c2);
    }
    for (; n >= 8; n -= 8, src += 8) c = _mm_crc32_u64(c, load64(src));
    for (; n; --n) c = _mm_crc32_u8(uint32_t(c), *src++);
    return uint32_t(c);
}
#endif

using Runner = uint32_t (*)(uint32_t, const uint8_t *, size_t);

Runner pick() {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2")) return run_sse42;
#endif
    return run_table;
}

Runner runner() {
    static const Runner r = pick();
    return r;
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void *data, size_t len) noexcept {
    return ~runner()(~crc, static_cast<const uint8_t *>(data), len);
}

// What was stored is what is checked, read again while it is in cache.
uint32_t crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len) noexcept {
    if (len) std::memcpy(dst, src, len);
    return crc32c(crc, dst, len);
}

uint32_t crc32c_portable(uint32_t crc, const void *data, size_t len) noexcept {
    return ~run_table(~crc, static_cast<const uint8_t *>(data), len);
}

}  // namespace sg
