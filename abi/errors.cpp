// The C ABI: versions, status names, the thread's last error and sg_error_info_t.
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

SG_API uint32_t sg_version_number(void) { return SG_VERSION_NUMBER; }
SG_API const char *sg_version_string(void) {
#define SG_STR2(x) #x
#define SG_STR(x) SG_STR2(x)
    return SG_STR(SG_VERSION_MAJOR) "." SG_STR(SG_VERSION_MINOR) "." SG_STR(SG_VERSION_PATCH);
}
SG_API uint32_t sg_abi_version(void) { return SG_ABI_VERSION; }

SG_API const char *sg_status_str(sg_status_t s) {
    switch (s) {
#define SG_CASE(x) \
    case x: return #x;
        SG_CASE(SG_OK)
        SG_CASE(SG_IN_PROGRESS)
        SG_CASE(SG_ERR_INVALID_ARGUMENT)
        SG_CASE(SG_ERR_INVALID_HANDLE)
        SG_CASE(SG_ERR_INVALID_LAYOUT)
        SG_CASE(SG_ERR_LAYOUT_MISMATCH)
        SG_CASE(SG_ERR_OUT_OF_RANGE)
        SG_CASE(SG_ERR_BUFFER_TOO_SMALL)
        SG_CASE(SG_ERR_INVALID_STATE)
        SG_CASE(SG_ERR_DUPLICATE)
        SG_CASE(SG_ERR_VERSION_MISMATCH)
        SG_CASE(SG_ERR_NOT_FOUND)
        SG_CASE(SG_ERR_NO_MEMORY)
        SG_CASE(SG_ERR_AGAIN)
        SG_CASE(SG_ERR_TIMEOUT)
        SG_CASE(SG_ERR_CANCELED)
        SG_CASE(SG_ERR_TRANSPORT)
        SG_CASE(SG_ERR_PEER_LOST)
        SG_CASE(SG_ERR_PROTOCOL)
        SG_CASE(SG_ERR_DEADLINE)
        SG_CASE(SG_ERR_AUTH_FAILED)
        SG_CASE(SG_ERR_AUTH_REQUIRED)
        SG_CASE(SG_ERR_LEASE_EXPIRED)
        SG_CASE(SG_ERR_CONNECT)
        SG_CASE(SG_ERR_REMOTE)
        SG_CASE(SG_ERR_UNSUPPORTED)
        SG_CASE(SG_ERR_NO_PROVIDER)
        SG_CASE(SG_ERR_INTERNAL)
#undef SG_CASE
    }
    return "SG_STATUS_UNKNOWN";
}

SG_API const char *sg_last_error_message(void) { return t_last_error.c_str(); }

SG_API void(sg_error_info_init)(sg_error_info_t *err) { sg_error_info_init_sized(err, sizeof *err); }
SG_API void sg_error_info_init_sized(sg_error_info_t *err, size_t size) {
    init_sized(err, size, zeroed_with_size<sg_error_info_t>());
}

SG_API size_t sg_dtype_size(sg_dtype_t d) { return size_t(sg::kv::dtype_bytes(d)); }

}  // extern "C"
