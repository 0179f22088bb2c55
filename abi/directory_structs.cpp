// The C ABI: the directory's option and statistics structs, whether or not the library was built
// with the directory.
#include "abi.hpp"

using namespace sg::abi;
using sg::Error;
using sg::fail;

SG_API void(sg_directory_options_init)(sg_directory_options_t *options) {
    sg_directory_options_init_sized(options, sizeof *options);
}
SG_API void sg_directory_options_init_sized(sg_directory_options_t *options, size_t size) {
    init_sized(options, size, default_directory_options());
}

// 0.5 appended two counters; the plain function keeps writing the 0.4 struct (see the assert above).
constexpr size_t kDirectoryStatsSize04 = offsetof(sg_directory_stats_t, names_taken_over);
SG_API void(sg_directory_stats_init)(sg_directory_stats_t *stats) {
    sg_directory_stats_init_sized(stats, kDirectoryStatsSize04);
}
SG_API void sg_directory_stats_init_sized(sg_directory_stats_t *stats, size_t size) {
    init_sized(stats, size, zeroed_with_size<sg_directory_stats_t>());
}
