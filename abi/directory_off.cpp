// The C ABI's directory entry points in a library built without it (SMARTGEN_DIRECTORY=OFF): each
// answers SG_ERR_UNSUPPORTED, destroying nothing (NULL is accepted as everywhere).
#include "abi.hpp"

using namespace sg::abi;
using sg::Error;
using sg::fail;


void sg::abi::destroy_directories_of(uint64_t) {}

namespace {
sg_status_t no_directory(sg_error_info_t *err) {
    return guard(err, []() -> sg_status_t {
        fail(SG_ERR_UNSUPPORTED, "this libsmartgen was built without the cluster directory (SMARTGEN_DIRECTORY=OFF)");
    });
}
}  // namespace

SG_API sg_status_t sg_directory_open(sg_context_t, const sg_directory_options_t *, sg_directory_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_publish(sg_directory_t, const char *, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_unpublish(sg_directory_t, const char *, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_lookup(sg_directory_t, const char *, uint64_t, void *, size_t, size_t *) {
    return no_directory(nullptr);
}
SG_API sg_status_t sg_directory_list(sg_directory_t, const char *, uint64_t, char *, size_t, size_t *, size_t *) {
    return no_directory(nullptr);
}
SG_API sg_status_t sg_directory_wait(sg_directory_t, const char *, int, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_connect(sg_directory_t, const char *, const sg_session_options_t *, uint64_t,
                                        sg_session_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_accept(sg_directory_t, uint64_t, sg_session_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_stats(sg_directory_t, sg_directory_stats_t *) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_destroy(sg_directory_t h) {
    return h ? no_directory(nullptr) : SG_OK;
}
