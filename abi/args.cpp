// The argument checks and the error funnel's recorder that every entry point shares (abi.hpp).
#include "abi.hpp"

#include <arpa/inet.h>
#include <netdb.h>

namespace sg::abi {

sg_status_t record(sg_status_t status, std::string_view prefix, std::string_view detail,
                   sg_error_info_t *err) noexcept {
    try {
        t_last_error.assign(prefix).append(detail);
    } catch (...) {
        t_last_error.clear();  // keeps its capacity: the appends below fit in it and cannot throw
        const size_t room = t_last_error.capacity();
        t_last_error.append(prefix.substr(0, room));
        t_last_error.append(detail.substr(0, room - t_last_error.size()));
    }
    if (err && err->struct_size >= offsetof(sg_error_info_t, message) + 1) {
        err->status = status;
        const size_t cap = std::min(sizeof err->message, err->struct_size - offsetof(sg_error_info_t, message));
        const size_t np = std::min(prefix.size(), cap - 1);
        const size_t nd = std::min(detail.size(), cap - 1 - np);
        std::memcpy(err->message, prefix.data(), np);
        std::memcpy(err->message + np, detail.data(), nd);
        err->message[np + nd] = '\0';
    }
    return status;
}

sg_status_t record(sg_status_t status, std::string_view message, sg_error_info_t *err) noexcept {
    return record(status, {}, message, err);
}

void check_bits(uint32_t value, uint32_t known, const char *field, const char *family) {
    if (value & ~known) {
        char hex[16];
        std::snprintf(hex, sizeof hex, "0x%x", value & ~known);
        fail(SG_ERR_INVALID_ARGUMENT, std::string(field) + " holds bits " + hex + " that are not " + family +
                                          " (unknown bits are refused)");
    }
}

void need(const void *p, const char *name) {
    if (!p) fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + " is NULL");
}

bool size_query(const void *buf, size_t cap, const char *name) {
    if (!buf && cap)
        fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + " is NULL with a capacity of " + std::to_string(cap) +
                                          " (NULL with capacity 0 asks for the size)");
    return !buf;
}

void check_detail_buffer(const char *msg, size_t cap) {
    if (!msg && cap) fail(SG_ERR_INVALID_ARGUMENT, "msg is NULL with a capacity of " + std::to_string(cap));
}

void copy_detail(const std::string &s, char *msg, size_t cap) {
    if (!msg || !cap) return;
    const size_t n = std::min(cap - 1, s.size());
    std::memcpy(msg, s.data(), n);
    msg[n] = '\0';
}

void copy_string(const std::string &s, char *buf, size_t cap) {
    need(buf, "buf");
    if (s.size() + 1 > cap) fail(SG_ERR_BUFFER_TOO_SMALL, "buffer needs " + std::to_string(s.size() + 1) + " bytes");
    std::memcpy(buf, s.c_str(), s.size() + 1);
}

void check_ip_literal(const char *addr, const char *field) {
    in_addr v4;
    if (inet_pton(AF_INET, addr, &v4) == 1) return;
    addrinfo hints{};
    hints.ai_family = AF_INET6;
    hints.ai_flags = AI_NUMERICHOST;
    addrinfo *res = nullptr;
    if (std::strchr(addr, ':') && getaddrinfo(addr, nullptr, &hints, &res) == 0) {
        freeaddrinfo(res);
        return;
    }
    fail(SG_ERR_INVALID_ARGUMENT, std::string(field) + " \"" + addr +
                                      "\" is not an IPv4 or IPv6 address literal (NULL means 127.0.0.1)");
}

void resolve_option_defaults(sg_context_options_t &o) {
    if (o.manual_progress > 1) fail(SG_ERR_INVALID_ARGUMENT, "options.manual_progress must be 0 or 1");
    if (o.allow_unauthenticated > 1) fail(SG_ERR_INVALID_ARGUMENT, "options.allow_unauthenticated must be 0 or 1");
    if (o.log_level > SG_LOG_DEBUG) fail(SG_ERR_INVALID_ARGUMENT, "options.log_level is out of range");
    if (o.log_level == SG_LOG_DEFAULT) o.log_level = SG_LOG_WARN;
    if (o.progress_spin_us == 0)
        o.progress_spin_us = defaults::kProgressSpinUs;
    else if (o.progress_spin_us == SG_PROGRESS_SPIN_NONE)
        o.progress_spin_us = 0;
    if (o.max_ops_in_flight == 0) o.max_ops_in_flight = defaults::kMaxOpsInFlight;
    if (o.max_ops_in_flight > defaults::kMaxOpsInFlightLimit)
        fail(SG_ERR_INVALID_ARGUMENT,
             "options.max_ops_in_flight must be <= " + std::to_string(defaults::kMaxOpsInFlightLimit));
}

}  // namespace sg::abi
