// The C ABI's older versions of symbols whose structs grew (abi/smartgen.map): what programs linked
// against 0.1 to 0.4 bind, kept by symbol versioning.
#include "abi.hpp"

using namespace sg::abi;

// 0.3 appended fields to sg_transfer_options_t and sg_transfer_stats_t, and their plain _init
// functions have no size to go by. The 0.1 versions write the 0.1/0.2 struct; the 0.3 versions, for
// programs linked against 0.3 and 0.4, write the whole 0.3 struct; the default (0.5) versions, which a
// program compiled against a vendored older header binds when linked today, write the 0.2 struct
// again: the smallest this SONAME shipped, so no header's struct is overrun. Programs compiled
// against this header call the _sized ones through the macros (docs/abi.md, "Growing a struct").
constexpr size_t kTransferOptionsSize01 = offsetof(sg_transfer_options_t, wire_quant);
constexpr size_t kTransferStatsSize01 = offsetof(sg_transfer_stats_t, quantized_bytes);

extern "C" SG_API void sg_transfer_options_init_v01(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, kTransferOptionsSize01);
}
__asm__(".symver sg_transfer_options_init_v01, sg_transfer_options_init@SMARTGEN_0.1");

extern "C" SG_API void sg_transfer_options_init_v03(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, sizeof *o);
}
__asm__(".symver sg_transfer_options_init_v03, sg_transfer_options_init@SMARTGEN_0.3");

extern "C" SG_API void sg_transfer_options_init_v05(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, kTransferOptionsSize01);
}
__asm__(".symver sg_transfer_options_init_v05, sg_transfer_options_init@@SMARTGEN_0.5");

extern "C" SG_API void sg_transfer_stats_init_v01(sg_transfer_stats_t *s) {
    sg_transfer_stats_init_sized(s, kTransferStatsSize01);
}
__asm__(".symver sg_transfer_stats_init_v01, sg_transfer_stats_init@SMARTGEN_0.1");

extern "C" SG_API void sg_transfer_stats_init_v03(sg_transfer_stats_t *s) { sg_transfer_stats_init_sized(s, sizeof *s); }
__asm__(".symver sg_transfer_stats_init_v03, sg_transfer_stats_init@SMARTGEN_0.3");

extern "C" SG_API void sg_transfer_stats_init_v05(sg_transfer_stats_t *s) {
    sg_transfer_stats_init_sized(s, kTransferStatsSize01);
}
__asm__(".symver sg_transfer_stats_init_v05, sg_transfer_stats_init@@SMARTGEN_0.5");
