// What the host reads of a session or a transfer (the ABI's getters), each a snapshot taken under
// the context's mutex, and the waits on a layer's state bits and on blocks: abi/ calls these and
// never reads a session's or a transfer's fields itself.
#include "core/core.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

namespace {

void check_layer(const Transfer &t, uint32_t layer) {
    if (layer >= t.num_layers())
        fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(t.num_layers()));
}

}  // namespace

Outcome Context::outcome(const Transfer &t) {
    std::lock_guard lock(mu);
    return {t.status, t.error};
}

Outcome Context::session_error(const Session &s) {
    std::lock_guard lock(mu);
    return {s.error, s.error_message};
}

sg_status_t Context::next_notification(Session &s, void *buf, size_t cap, bool query, size_t &len) {
    std::lock_guard lock(mu);
    if (s.notifications.empty()) return SG_ERR_AGAIN;
    const auto &front = s.notifications.front();
    len = front.size();
    if (query) return SG_OK;  // the notification stays for the call that takes it
    if (cap < front.size()) fail(SG_ERR_BUFFER_TOO_SMALL, "notification needs " + std::to_string(front.size()) + " bytes");
    std::memcpy(buf, front.data(), front.size());
    s.notifications.pop_front();
    return SG_OK;
}

uint32_t Context::layer_state(const Transfer &t, uint32_t layer) {
    check_layer(t, layer);
    std::lock_guard lock(mu);
    const Transfer::Layer &L = t.layers[layer];
    return (L.out.written ? SG_LAYER_WRITTEN : 0u) | (L.ready ? SG_LAYER_READY : 0u) |
           (L.essential ? SG_LAYER_ESSENTIAL : 0u);
}

uint64_t Context::layer_time(const Transfer &t, uint32_t layer) {
    check_layer(t, layer);
    std::lock_guard lock(mu);
    const Transfer::Layer &L = t.layers[layer];
    const uint64_t from = std::max(t.stats.start_ns, L.out.written_ns);
    return L.ready && L.ready_ns > from ? L.ready_ns - from : 0;
}

void Context::residency(const Transfer &t, uint32_t layer, uint8_t *bitmap, size_t cap, size_t &num_bits) {
    check_layer(t, layer);
    std::lock_guard lock(mu);
    const size_t nb = t.residency.num_blocks();
    num_bits = nb;  // reported also when the buffer is too small (the caller-buffer rule)
    if (!bitmap) return;
    if (cap < (nb + 7) / 8) fail(SG_ERR_BUFFER_TOO_SMALL, "bitmap needs " + std::to_string((nb + 7) / 8) + " bytes");
    t.residency.copy_layer(layer, bitmap);
}

sg_transfer_stats_t Context::transfer_stats(const Transfer &t) {
    std::lock_guard lock(mu);
    sg_transfer_stats_t s = t.stats;
    s.bytes_full = t.selective() ? 0 : s.bytes;
    return s;
}

sg_status_t Context::wait_layer_state(Transfer &t, uint32_t layer, uint32_t bits, uint64_t timeout_ns) {
    check_layer(t, layer);
    const Transfer::Layer &L = t.layers[layer];
    bool no_proactive = false;
    const sg_status_t st = wait_for(t, timeout_ns, [&] {
        // The decode side learns the paths at the match; without the proactive path the essential
        // bit never comes.
        no_proactive = (bits & SG_LAYER_ESSENTIAL) && t.paths && !(t.paths & SG_PATH_PROACTIVE);
        if (no_proactive) return true;
        return (!(bits & SG_LAYER_WRITTEN) || L.out.written || !t.post_side) && (!(bits & SG_LAYER_READY) || L.ready) &&
               (!(bits & SG_LAYER_ESSENTIAL) || L.essential);
    });
    if (no_proactive) fail(SG_ERR_INVALID_STATE, "SG_LAYER_ESSENTIAL needs SG_PATH_PROACTIVE, which the transfer lacks");
    return st;
}

sg_status_t Context::wait_blocks(Transfer &t, uint32_t layer, std::span<const uint32_t> blocks, uint64_t timeout_ns) {
    check_layer(t, layer);
    for (size_t i = 0; i < blocks.size(); ++i)
        if (blocks[i] >= t.residency.num_blocks())
            fail(SG_ERR_OUT_OF_RANGE, "blocks[" + std::to_string(i) + "] is beyond the request's block table");
    // Resident blocks stay usable whatever happens to the transfer later (a lease that ended, a
    // peer that went away): they are checked first.
    return wait_for(t, timeout_ns, [&] {
        for (uint32_t b : blocks)
            if (!t.residency.test(layer, b)) return false;
        return true;
    });
}

// Prometheus's text exposition format: a HELP and TYPE line per family, then its samples.
std::string Context::metrics_text() {
    const sg_context_stats_t s = stats();
    struct Metric {
        const char *name, *type, *help;
        uint64_t value;
    };
    const Metric metrics[] = {
        {"smartgen_bytes_total{path=\"direct\"}", "counter", "Payload bytes sent, by path.", s.bytes_direct},
        {"smartgen_bytes_total{path=\"staged\"}", nullptr, nullptr, s.bytes_staged},
        {"smartgen_rma_ops_total", "counter", "RMA operations posted.", s.rma_ops},
        {"smartgen_staging_copies_total", "counter", "memcpy calls made by staging pack and unpack.", s.staging_copies},
        {"smartgen_messages_total{direction=\"sent\"}", "counter", "Control messages.", s.messages_sent},
        {"smartgen_messages_total{direction=\"received\"}", nullptr, nullptr, s.messages_received},
        {"smartgen_retries_total", "counter", "Posts the provider refused for now and that were retried.", s.retries},
        {"smartgen_transfers_total{result=\"completed\"}", "counter", "Transfers finished, by result.",
         s.transfers_completed},
        {"smartgen_transfers_total{result=\"failed\"}", nullptr, nullptr, s.transfers_failed},
        {"smartgen_transfers_canceled_total", "counter", "Transfers canceled.", s.transfers_canceled},
        {"smartgen_deadlines_hit_total", "counter", "Transfers that missed their deadline.", s.deadlines_hit},
        {"smartgen_peers_lost_total", "counter", "Sessions whose peer was lost.", s.peers_lost},
        {"smartgen_sessions_open", "gauge", "Sessions currently open.", s.sessions_open},
        {"smartgen_auth_failures_total", "counter", "Sessions refused by authentication.", s.auth_failures},
        {"smartgen_stalls_total", "counter", "Times a transfer with work waited for the in-flight bounds.", s.stalls},
        {"smartgen_registrations", "gauge", "Memory registrations held now.", s.registrations},
        {"smartgen_lanes", "gauge", "Lanes the context stripes writes over.", s.lanes},
        {"smartgen_lane_failovers_total", "counter", "Writes moved off a failed lane.", s.lane_failovers},
        {"smartgen_lanes_lost_total", "counter", "(peer, lane) pairs given up after an error.", s.lanes_lost},
    };
    std::string text;
    for (const Metric &m : metrics) {
        if (m.type) {
            std::string base(m.name);
            base = base.substr(0, base.find('{'));
            text += "# HELP " + base + " " + m.help + "\n# TYPE " + base + " " + m.type + "\n";
        }
        text += std::string(m.name) + " " + std::to_string(m.value) + "\n";
    }
    return text;
}

}  // namespace sg::core
