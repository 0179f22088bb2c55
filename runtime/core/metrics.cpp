// The context's statistics in Prometheus's text format (sg_context_metrics_text).
#include "core/core.hpp"

namespace sg::core {

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
        {"smartgen_blocks_verified_total", "counter", "Blocks whose content CRC was checked on arrival.",
         s.blocks_verified},
        {"smartgen_verify_mismatches_total", "counter", "Blocks whose content did not match the sender's CRC.",
         s.verify_mismatches},
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
