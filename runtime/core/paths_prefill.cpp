// The selective paths of a transfer (SG_PATH_PROACTIVE, SG_PATH_ON_DEMAND, SG_PATH_SPECULATIVE).
//
// The prefill side cuts the request into send units: blocks of one layer that go under one path and
// end with one BlocksReady notice, sent once the unit's writes are delivered (or right after them
// where the provider orders sends after writes). Every block is claimed by exactly one unit, so no
// byte goes twice: the proactive unit of a layer claims its essential blocks when the layer is
// written, a fetch claims what is still unclaimed, and the speculative path claims the rest in small
// units. The scheduler serves on-demand units before anything else, then proactive and full-path
// work, then speculative units, whose bytes in flight per session are kept small so that a fetch
// never queues behind much bulk.
//
// The decode side keeps a residency bit per block; a layer is ready when every block is resident
// and essential when its proactive notice and all the digests announced in it have arrived.
#include "core/paths.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

using namespace paths;


// ---- prefill: layers written, units claimed -----------------------------------------------------

namespace {

bool needs_keys(const select::Selector &sel, uint32_t layer, uint32_t kv_heads) {
    if (!sel.needs_scores(layer)) return false;
    for (uint32_t h = 0; h < kv_heads; ++h)
        if (sel.rule(layer, h).policy == select::Policy::snapkv) return true;
    return false;
}

}  // namespace

PreparedLayer Transfer::prepare_layer(uint32_t layer, const float *queries, uint32_t num_queries,
                                              uint32_t num_q_heads) {
    PreparedLayer prep;
    if (!(paths() & SG_PATH_PROACTIVE)) return prep;
    const kv::Layout &L = pool->layout;
    const uint32_t nb = request_blocks(*this);
    std::vector<float> digest(kernels::digest_floats(nb, L.num_kv_heads, L.head_dim));
    layer_digest(L, pool->region(layer, 0), table, num_tokens, digest.data());
    select::LayerSelection chosen;
    {
        std::lock_guard lock(sel().select_mu);
        // SnapKV reads the keys themselves: a device pool's through a host copy, made only then.
        HostKeys keys;
        if (needs_keys(sel().selector->selector(), layer, L.num_kv_heads))
            keys = host_keys(L, pool->region(layer, 0), table);
        ScoreInput in;
        in.queries = queries;
        in.num_queries = num_queries;
        in.num_q_heads = num_q_heads;
        in.digests = digest.data();
        in.keys_layout = keys.k_region ? &keys.layout : nullptr;
        in.k_region = keys.k_region;
        in.table = keys.table;
        sel().selector->select(layer, in, chosen);
    }
    prep.selected.assign(chosen.blocks.begin(), chosen.blocks.end());
    prep.digests.resize(digest.size() * L.elem_bytes);
    encode_digests(L, digest.data(), digest.size(), prep.digests.data());
    return prep;
}

// The errors a written layer's selection would meet, reported to the caller instead of failing the
// transfer later on the worker.
void Transfer::check_selection_inputs(uint32_t layer, const float *queries, uint32_t num_queries,
                                     uint32_t num_q_heads) {
    if (!sel().selector) return;
    const select::Selector &rules = sel().selector->selector();
    if (!rules.needs_scores(layer)) return;
    const kv::Layout &L = pool->layout;
    for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
        const select::Policy p = rules.rule(layer, h).policy;
        if (p == select::Policy::h2o)
            fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) +
                                              ": h2o needs accumulated attention, which the proactive path does not "
                                              "take (use it through sg_selector_select)");
        if ((p == select::Policy::quest || p == select::Policy::snapkv) && (!queries || !num_queries))
            fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) +
                                              ": its policy needs queries (sg_transfer_layer_written_q)");
    }
    if (queries && num_queries && (!num_q_heads || num_q_heads % L.num_kv_heads))
        fail(SG_ERR_INVALID_ARGUMENT, "num_q_heads must be a positive multiple of num_kv_heads");
}

void Context::select_loop() {
    std::unique_lock qlock(select_mu_);
    for (;;) {
        select_cv_.wait(qlock, [&] { return select_stop_ || !select_jobs_.empty(); });
        if (select_stop_) return;
        SelectJob job = std::move(select_jobs_.front());
        select_jobs_.pop_front();
        qlock.unlock();
        Transfer &t = *job.t;
        // Nothing thrown here may end the host process: a failure fails this transfer.
        auto fail_job = [&](sg_status_t st, const std::string &why) {
            try {
                std::lock_guard lock(mu);
                t.fail_with(st, "selecting layer " + std::to_string(job.layer) + ": " + why, true);
            } catch (...) {
                log.log(SG_LOG_ERROR, "selection worker: failing a transfer failed: " + why);
            }
        };
        if (t.released.load(std::memory_order_acquire)) {
            // Released or ended meanwhile: nobody will read this selection.
        } else try {
            // The engine's kernels may still be writing the layer: nothing reads it before the
            // event recorded on their stream has completed (the stream itself is never waited on).
            if (job.written)
                while (!job.written->done() && !t.released.load(std::memory_order_acquire) && !t.finished())
                    std::this_thread::sleep_for(std::chrono::microseconds(20));
            if (job.device_queries) {
                job.queries.resize(size_t(job.num_queries) * job.num_q_heads * t.pool->layout.head_dim);
                const std::pair<const uint8_t *, uint64_t> piece{reinterpret_cast<const uint8_t *>(job.device_queries),
                                                                 job.queries.size() * sizeof(float)};
                cuda_stage_out(t.pool->layout.device, std::span(&piece, 1), reinterpret_cast<uint8_t *>(job.queries.data()));
            }
            if (!job.select) {
                t.mark_written(job.layer);
                job.t.reset();
                qlock.lock();
                continue;
            }
            PreparedLayer prep = t.prepare_layer(job.layer, job.queries.empty() ? nullptr : job.queries.data(),
                                               job.num_queries, job.num_q_heads);
            std::lock_guard lock(mu);
            t.commit_layer(job.layer, std::move(prep));
            if (t.matched() && !t.finished()) t.pump_selective(1, plan::kTurnQuota);
        } catch (const Error &e) {
            fail_job(e.status(), e.message());
        } catch (const std::bad_alloc &) {
            fail_job(SG_ERR_NO_MEMORY, "out of memory");
        } catch (const std::exception &e) {
            fail_job(SG_ERR_INTERNAL, e.what());
        } catch (...) {
            fail_job(SG_ERR_INTERNAL, "unknown exception");
        }
        wake();
        job.t.reset();  // the last reference may go here; never with select_mu_ held
        qlock.lock();
    }
}

// A fetch may name blocks that a speculative unit has claimed but not begun to send (it waits for
// the in-flight bound, or for the pause the fetch itself causes): such units give their blocks
// back, so the fetch takes them and the speculative path comes back for the rest later.
void Transfer::release_unposted_speculative(uint32_t layer, std::span<const uint32_t> wanted) {
    auto &q = sel().speculative_queue;
    for (auto it = q.begin(); it != q.end();) {
        SendUnit &u = **it;
        if (u.next_op != 0) {
            // Under way: it cannot give blocks back, but it must not pause while it holds wanted ones.
            if (u.layer == layer)
                for (uint32_t b : wanted)
                    if (std::binary_search(u.blocks.begin(), u.blocks.end(), b)) u.urgent = true;
            ++it;
            continue;
        }
        Transfer::Layer &L = layers[u.layer];
        for (uint32_t b : u.blocks) {
            L.out.claimed[b] = 0;
            L.out.claimed_count--;
        }
        if (!u.blocks.empty()) L.out.spec_cursor = std::min(L.out.spec_cursor, u.blocks.front());
        // Send order: the speculative path resumes at the earliest layer that has blocks again.
        for (uint32_t i = 0; i < sel().spec_order_pos; ++i)
            if (prefill().order[i] == u.layer) {
                sel().spec_order_pos = i;
                break;
            }
        it = q.erase(it);
    }
}

std::unique_ptr<SendUnit> Transfer::claim(uint32_t layer, const UnitPath &path, std::span<const uint32_t> want) {
    auto u = std::make_unique<SendUnit>();
    u->layer = layer;
    u->path = &path;
    Transfer::Layer &L = layers[layer];
    for (uint32_t b : want) {
        if (b >= L.out.claimed.size() || L.out.claimed[b]) continue;
        L.out.claimed[b] = 1;
        L.out.claimed_count++;
        u->blocks.push_back(b);
    }
    std::sort(u->blocks.begin(), u->blocks.end());
    return u;
}

// Whether a selective transfer's layer goes whole, every block as proactive, instead of its essential
// blocks first: when streaming cannot be beaten. That is where the link carries a whole layer in the
// time the engine takes to write one (the measured delivery rate of this session's bulk times the
// interval since the last layer was written), and where the peer is on this host (a provider for
// local peers moves memory, faster than any prefill writes it). Then the decode side holds each layer
// whole as soon as streaming would, and attends to it whole (seamless): the selective paths cost what
// streaming costs. Only with the speculative path on: without it the host asked for the essential
// blocks alone. The margin (1.25) keeps a link that only just keeps up on the selective side: there a
// whole layer would delay the next layers' essential blocks.
bool Transfer::stream_whole(uint64_t interval_ns) const {
    if (!(paths() & SG_PATH_SPECULATIVE)) return false;
    const Session &s = *session;
    if (s.tp->caps().local_only) return true;
    if (!(s.bulk_rate > 0) || !interval_ns) return false;
    const double layer_bytes = double(block_bytes(pool->layout)) * request_blocks(*this);
    return s.bulk_rate * double(interval_ns) >= 1.25 * layer_bytes;
}

// A speculative unit delivered: the session's bulk rate over windows of at least 5 ms of deliveries.
// Gaps (the path paused for fetches, or waiting for essential blocks) count as time: the rate is a
// lower bound, which errs on the selective side.
void Session::note_bulk_delivered(uint64_t bytes) {
    constexpr uint64_t kRateWindowNs = 5000000;
    const uint64_t now = now_ns();
    if (!rate_window_ns) {
        rate_window_ns = now;
        rate_window_bytes = 0;
        return;  // the first unit's delivery starts the window: its own time is unknown
    }
    rate_window_bytes += bytes;
    if (now - rate_window_ns < kRateWindowNs) return;
    const double rate = double(rate_window_bytes) / double(now - rate_window_ns);
    bulk_rate = bulk_rate > 0 ? 0.5 * bulk_rate + 0.5 * rate : rate;
    rate_window_ns = now;
    rate_window_bytes = 0;
}

// The layer's proactive unit claims every block (the layer goes whole).
void Transfer::queue_whole_layer(uint32_t layer) {
    std::vector<uint32_t> every(layers[layer].out.claimed.size());
    for (uint32_t b = 0; b < every.size(); ++b) every[b] = b;
    sel().proactive_queue.push_back(claim(layer, UnitPath::kProactive, every));
    sel().layers_whole++;
}

// A written layer of a selective transfer that goes whole (stream_whole): committed at once, with no
// selection and no digests (the decode side holds every block, so no selection needs them), and
// sent as one proactive unit. False when the layer takes the selective way (the caller queues its
// selection).
bool Transfer::commit_whole_layer(uint32_t layer) {
    if (!(paths() & SG_PATH_PROACTIVE)) return false;
    std::lock_guard lock(ctx->mu);
    Transfer::Layer &L = layers[layer];
    if (L.out.written()) return false;
    const uint64_t now = now_ns();
    if (!stream_whole(sel().last_written_ns ? now - sel().last_written_ns : 0)) return false;
    L.out.advance(LayerStep::Written);
    L.out.written_ns = now;
    sel().last_written_ns = now;
    sel().layers_written++;
    queue_whole_layer(layer);
    if (matched() && !finished()) pump_selective(1, plan::kTurnQuota);
    ctx->wake();
    return true;
}

void Transfer::commit_layer(uint32_t layer, PreparedLayer &&prep) {
    Transfer::Layer &L = layers[layer];
    if (L.out.written()) return;
    L.out.advance(LayerStep::Written);
    L.out.written_ns = now_ns();
    const uint64_t interval = sel().last_written_ns ? L.out.written_ns - sel().last_written_ns : 0;
    sel().last_written_ns = L.out.written_ns;
    sel().layers_written++;
    if (paths() & SG_PATH_PROACTIVE) {
        L.out.selected = std::move(prep.selected);
        L.digests = std::move(prep.digests);
        // The proactive unit goes even when empty: its notice is what makes the layer essential.
        if (stream_whole(interval)) {
            queue_whole_layer(layer);
        } else {
            sel().proactive_queue.push_back(claim(layer, UnitPath::kProactive, L.out.selected));
        }
    }
    if (!L.out.demand_waiting.empty()) {
        auto u = claim(layer, UnitPath::kOnDemand, L.out.demand_waiting);
        stats.fetch_blocks += u->blocks.size();
        if (!u->blocks.empty()) sel().demand_queue.push_back(std::move(u));
        L.out.demand_waiting.clear();
    }
    if (sel().layers_written == layers.size() && options.lease_ns)
        prefill().lease_deadline_ns = saturating_add(now_ns(), options.lease_ns);
}

}  // namespace sg::core
