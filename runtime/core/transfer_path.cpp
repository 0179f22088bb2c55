// The two paths' tables (transfer_path.hpp): each step of a transfer where streaming the whole
// cache and the selective paths differ, written once per path.
#include "core/core.hpp"
#include "core/paths.hpp"

namespace sg::core {

namespace {

void no_check(const Transfer &) {}

}  // namespace

const TransferPath TransferPath::kFull{
    .name = "full",
    .whole = true,
    .prepare = [](Transfer &, const select::Profile *, std::vector<PreparedLayer> &) {},
    .commit_written =
        [](Transfer &t, std::vector<PreparedLayer> &) {
            if (!(t.options.flags & SG_TRANSFER_ALL_LAYERS_WRITTEN)) return;
            const uint64_t now = now_ns();
            for (auto &L : t.layers) {
                L.out.advance(Transfer::LayerStep::Written);
                L.out.written_ns = now;
            }
        },
    .check_peer = no_check,
    .pump = [](Transfer &t, int pass, uint32_t quota) { return pass == int(plan::PathClass::Bulk) && t.pump(quota); },
    .layer_written =
        [](Transfer &t, uint32_t layer, LayerWrite &&w) {
            if (w.written) {
                // A device pool's layer written on the engine's stream: the selection worker waits
                // for the stream, then marks it.
                t.ctx->queue_job(Context::SelectJob{t.shared_from_this(), layer, {}, 0, 0, std::move(w.written), false});
                return;
            }
            t.mark_written(layer);
        },
    .begin_decode = [](Transfer &) {},
    .chunk_landed = [](Transfer &t, uint32_t) { t.layers_ready_in_order(); },
    .release_unfinished = [](Transfer &t) { t.fail_with(SG_ERR_CANCELED, "released before completion", true); },
};

const TransferPath TransferPath::kSelective{
    .name = "selective",
    .whole = false,
    .prepare =
        [](Transfer &t, const select::Profile *profile, std::vector<PreparedLayer> &prepared) {
            const kv::Layout &L = t.pool->layout;
            const uint32_t nb = uint32_t(kernels::num_blocks(t.num_tokens, L.tokens_per_block));
            for (auto &layer : t.layers) layer.out.claimed.assign(nb, 0);
            if (t.paths() & SG_PATH_PROACTIVE) {
                kernel_dtype(L.dtype);  // selection reads fp32, fp16 and bf16 keys
                const select::Profile p =
                    profile ? *profile : default_profile(L.num_layers, L.num_kv_heads, L.tokens_per_block);
                if (p.num_layers != L.num_layers || p.block_tokens != L.tokens_per_block)
                    fail(SG_ERR_LAYOUT_MISMATCH, "the profile is for " + std::to_string(p.num_layers) + " layers of " +
                                                     std::to_string(p.block_tokens) + "-token blocks, the pool has " +
                                                     std::to_string(L.num_layers) + " of " +
                                                     std::to_string(L.tokens_per_block));
                t.sel().selector =
                    std::make_unique<LayerSelector>(p, L.num_kv_heads, L.head_dim, t.num_tokens, 2 * L.row_bytes());
            }
            if (t.options.flags & SG_TRANSFER_ALL_LAYERS_WRITTEN)
                for (uint32_t l = 0; l < t.num_layers(); ++l) prepared.push_back(t.prepare_layer(l, nullptr, 0, 0));
        },
    .commit_written =
        [](Transfer &t, std::vector<PreparedLayer> &prepared) {
            for (uint32_t l = 0; l < prepared.size(); ++l) t.commit_layer(l, std::move(prepared[l]));
        },
    .check_peer =
        [](const Transfer &t) {
            const uint32_t ours = t.pool->layout.tokens_per_block, theirs = t.prefill().dst->layout.tokens_per_block;
            if (ours != theirs)
                fail(SG_ERR_LAYOUT_MISMATCH, "the selective paths need the same tokens_per_block on both sides (prefill " +
                                                 std::to_string(ours) + ", decode " + std::to_string(theirs) + ")");
        },
    .pump = [](Transfer &t, int pass, uint32_t quota) { return t.pump_selective(pass, quota); },
    .layer_written =
        [](Transfer &t, uint32_t layer, LayerWrite &&w) {
            if (!w.written && t.commit_whole_layer(layer)) return;
            t.check_selection_inputs(layer, w.queries, w.num_queries, w.num_q_heads);
            Context::SelectJob job{t.shared_from_this(), layer, {}, w.num_queries, w.num_q_heads, std::move(w.written),
                                   true};
            if (w.queries && w.num_queries && w.device_queries)
                job.device_queries = w.queries;
            else if (w.queries && w.num_queries)
                job.queries.assign(w.queries,
                                   w.queries + size_t(w.num_queries) * w.num_q_heads * t.pool->layout.head_dim);
            t.ctx->queue_job(std::move(job));
        },
    .begin_decode =
        [](Transfer &t) {
            const uint32_t nb = paths::request_blocks(t);
            for (auto &L : t.layers) L.in.requested.assign(nb, 0);
        },
    .chunk_landed = [](Transfer &t, uint32_t layer) { t.apply_held_notices(layer); },
    .release_unfinished = [](Transfer &t) { t.end_by_release(); },
};

const UnitPath UnitPath::kProactive{"proactive", SG_PATH_PROACTIVE, &sg_transfer_stats_t::bytes_proactive,
                                    &Session::proactive_inflight, false, false, true};
const UnitPath UnitPath::kOnDemand{"on-demand", SG_PATH_ON_DEMAND, &sg_transfer_stats_t::bytes_on_demand, nullptr, true,
                                   false, false};
const UnitPath UnitPath::kSpeculative{"speculative", SG_PATH_SPECULATIVE, &sg_transfer_stats_t::bytes_speculative,
                                      &Session::speculative_inflight, false, true, false};

const UnitPath &UnitPath::of(uint32_t bit) {
    switch (bit) {
        case SG_PATH_PROACTIVE: return kProactive;
        case SG_PATH_ON_DEMAND: return kOnDemand;
        case SG_PATH_SPECULATIVE: return kSpeculative;
        default: fail(SG_ERR_PROTOCOL, "path " + std::to_string(bit) + " is not one of the selective paths");
    }
}

const TransferPath &TransferPath::of(uint32_t paths) {
    return paths && paths != SG_PATH_FULL ? kSelective : kFull;
}

void Transfer::set_paths(uint32_t paths) {
    paths_ = paths;
    path_ = &TransferPath::of(paths);
}

}  // namespace sg::core
