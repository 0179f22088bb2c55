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

namespace {

// Digests go as control messages in runs below the frame limit.
constexpr uint64_t kDigestChunkBytes = 192 * 1024;
// Speculative bytes in flight per session: what an on-demand fetch may find ahead of it (50 us at
// 10 Gbit/s). Completed writes have left the socket buffer, so this bound also keeps the kernel's
// queue short. Measured on a 10 Gbit/s link: at 2 MiB a fetch waited 2-3 ms behind bulk, at 128 KiB
// 0.47-0.52 ms (1.8-2.0x idle), at 64 KiB 0.26-0.31 ms (0.8-1.3x), with the bulk alone at the
// link's rate each time; over loopback 64 KiB holds speculative bulk to about 2.5 GB/s.
constexpr uint64_t kSpeculativeInflightBytes = 64 * 1024;
// Speculative writes are cut to this size so the bound above is fine-grained.
constexpr uint64_t kSpeculativeOpBytes = 64 * 1024;
// A decode step fetches layer after layer, each a round trip after the last: for this long after a
// fetch the speculative path posts nothing new, so the step's later fetches find the link idle.
// It must outlast a fetch's own round trip, which includes what the kernel's socket buffers and the
// link's queue already hold (writes complete when handed to the kernel, so the in-flight bound
// does not count those bytes).
constexpr uint64_t kSpeculativeYieldNs = 10000000;
// Proactive bytes in flight per session: whatever sits in the provider's queue when decode starts its
// step is ahead of token 1's message and of the step's first fetch. Two staging slots while layers
// are being written (enough to keep a 10 Gbit/s link busy: ~7 ms of it), 256 KiB once the decode side
// may be fetching: after a fetch, and from the moment every layer is written. Measured on a 10 Gbit/s
// link with the session's 32 MiB as the only bound: the first five fetches of a step waited 25-41 ms
// each behind the last layers' proactive writes, token 1's message 80 ms; the later fetches 1-2 ms.
constexpr uint64_t kProactiveInflightBytes = 8ull << 20;
constexpr uint64_t kProactiveFetchFriendlyBytes = 256 * 1024;
// Size of one speculative unit: small enough that the path yields often, large enough that its
// notices cost little.
constexpr uint64_t kSpeculativeUnitBytes = 512 * 1024;
// Where the transport keeps bulk apart (lanes: speculative writes on lanes > 0, fetch replies and
// every message on lane 0), the speculative bytes in flight are not what a fetch finds ahead of it in
// its socket buffer: they wait in their own. Writes there complete when delivered, so this bound is
// what may be between the two processes, kernel buffers included, and it must cover the delivery
// acknowledgement's round trip at the link's rate: at 64 KiB (the bound above) the path carried
// about 170 MB/s over a 10 Gbit/s link, at 16 MiB the link's rate. The pause after a fetch stays: the
// bulk still shares the link's queue with the fetches, and a drop-tail queue that bulk keeps full
// makes a fetch wait behind it and lose packets with it (measured: step 2's 32 fetches waited
// 250-280 ms without the pause, 68-98 ms with it).
constexpr uint64_t kApartSpeculativeInflightBytes = 16ull << 20;
// Larger writes where the bulk is apart: a connection of small writes carries less (one iperf3
// stream over the shaped link: 64 KiB writes 5.2 Gbit/s, 1 MB 9.5).
constexpr uint64_t kApartSpeculativeOpBytes = 256 * 1024;
// A provider for peers on this host (shm) has no socket buffer: what a fetch finds ahead of it is
// what is in flight, copied at memory speed. 2 MiB is about 0.5 ms of it, and lets the path keep
// up with a prefill that writes a layer every 10 ms (the 64 KiB bound held it near 2.5 GB/s, below
// the 3.2 GB/s an emulated 8K-token Llama-3-8B's layers arrive at, so step 2 selected and fetched
// where streaming had every layer in place).
constexpr uint64_t kLocalSpeculativeInflightBytes = 2ull << 20;

}  // namespace

// ---- prefill: layers written, units claimed -----------------------------------------------------

namespace {

bool needs_keys(const select::Selector &sel, uint32_t layer, uint32_t kv_heads) {
    if (!sel.needs_scores(layer)) return false;
    for (uint32_t h = 0; h < kv_heads; ++h)
        if (sel.rule(layer, h).policy == select::Policy::snapkv) return true;
    return false;
}

}  // namespace

Context::PreparedLayer Context::prepare_layer(Transfer &t, uint32_t layer, const float *queries, uint32_t num_queries,
                                              uint32_t num_q_heads) {
    PreparedLayer prep;
    if (!(t.paths & SG_PATH_PROACTIVE)) return prep;
    const kv::Layout &L = t.pool->layout;
    const uint32_t nb = request_blocks(t);
    std::vector<float> digest(kernels::digest_floats(nb, L.num_kv_heads, L.head_dim));
    layer_digest(L, t.pool->region(layer, 0), t.table, t.num_tokens, digest.data());
    select::LayerSelection sel;
    {
        std::lock_guard lock(t.sel.select_mu);
        // SnapKV reads the keys themselves: a device pool's through a host copy, made only then.
        HostKeys keys;
        if (needs_keys(t.sel.selector->selector(), layer, L.num_kv_heads))
            keys = host_keys(L, t.pool->region(layer, 0), t.table);
        ScoreInput in;
        in.queries = queries;
        in.num_queries = num_queries;
        in.num_q_heads = num_q_heads;
        in.digests = digest.data();
        in.keys_layout = keys.k_region ? &keys.layout : nullptr;
        in.k_region = keys.k_region;
        in.table = keys.table;
        t.sel.selector->select(layer, in, sel);
    }
    prep.selected.assign(sel.blocks.begin(), sel.blocks.end());
    prep.digests.resize(digest.size() * L.elem_bytes);
    encode_digests(L, digest.data(), digest.size(), prep.digests.data());
    return prep;
}

// The errors a written layer's selection would meet, reported to the caller instead of failing the
// transfer later on the worker.
void Context::check_selection_inputs(Transfer &t, uint32_t layer, const float *queries, uint32_t num_queries,
                                     uint32_t num_q_heads) {
    if (!t.sel.selector) return;
    const select::Selector &sel = t.sel.selector->selector();
    if (!sel.needs_scores(layer)) return;
    const kv::Layout &L = t.pool->layout;
    for (uint32_t h = 0; h < L.num_kv_heads; ++h) {
        const select::Policy p = sel.rule(layer, h).policy;
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
                fail_transfer(t, st, "selecting layer " + std::to_string(job.layer) + ": " + why, true);
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
                mark_written(t, job.layer);
                job.t.reset();
                qlock.lock();
                continue;
            }
            PreparedLayer prep = prepare_layer(t, job.layer, job.queries.empty() ? nullptr : job.queries.data(),
                                               job.num_queries, job.num_q_heads);
            std::lock_guard lock(mu);
            commit_layer(t, job.layer, std::move(prep));
            if (t.matched() && !t.finished()) pump_selective(t, 1, plan::kTurnQuota);
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
void Context::release_unposted_speculative(Transfer &t, uint32_t layer, std::span<const uint32_t> wanted) {
    auto &q = t.sel.speculative_queue;
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
        Transfer::Layer &L = t.layers[u.layer];
        for (uint32_t b : u.blocks) {
            L.out.claimed[b] = 0;
            L.out.claimed_count--;
        }
        if (!u.blocks.empty()) L.out.spec_cursor = std::min(L.out.spec_cursor, u.blocks.front());
        // Send order: the speculative path resumes at the earliest layer that has blocks again.
        for (uint32_t i = 0; i < t.sel.spec_order_pos; ++i)
            if (t.prefill.order[i] == u.layer) {
                t.sel.spec_order_pos = i;
                break;
            }
        it = q.erase(it);
    }
}

std::unique_ptr<SendUnit> Context::claim(Transfer &t, uint32_t layer, uint32_t path, std::span<const uint32_t> want) {
    auto u = std::make_unique<SendUnit>();
    u->layer = layer;
    u->path = path;
    Transfer::Layer &L = t.layers[layer];
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
bool Context::stream_whole(const Transfer &t, uint64_t interval_ns) const {
    if (!(t.paths & SG_PATH_SPECULATIVE)) return false;
    const Session &s = *t.session;
    if (s.tp->caps().local_only) return true;
    if (!(s.bulk_rate > 0) || !interval_ns) return false;
    const double layer_bytes = double(block_bytes(t.pool->layout)) * request_blocks(t);
    return s.bulk_rate * double(interval_ns) >= 1.25 * layer_bytes;
}

// A speculative unit delivered: the session's bulk rate over windows of at least 5 ms of deliveries.
// Gaps (the path paused for fetches, or waiting for essential blocks) count as time: the rate is a
// lower bound, which errs on the selective side.
void Context::note_bulk_delivered(Session &s, uint64_t bytes) {
    constexpr uint64_t kRateWindowNs = 5000000;
    const uint64_t now = now_ns();
    if (!s.rate_window_ns) {
        s.rate_window_ns = now;
        s.rate_window_bytes = 0;
        return;  // the first unit's delivery starts the window: its own time is unknown
    }
    s.rate_window_bytes += bytes;
    if (now - s.rate_window_ns < kRateWindowNs) return;
    const double rate = double(s.rate_window_bytes) / double(now - s.rate_window_ns);
    s.bulk_rate = s.bulk_rate > 0 ? 0.5 * s.bulk_rate + 0.5 * rate : rate;
    s.rate_window_ns = now;
    s.rate_window_bytes = 0;
}

// The layer's proactive unit claims every block (the layer goes whole).
void Context::queue_whole_layer(Transfer &t, uint32_t layer) {
    std::vector<uint32_t> every(t.layers[layer].out.claimed.size());
    for (uint32_t b = 0; b < every.size(); ++b) every[b] = b;
    t.sel.proactive_queue.push_back(claim(t, layer, SG_PATH_PROACTIVE, every));
    t.sel.layers_whole++;
}

// A written layer of a selective transfer that goes whole (stream_whole): committed at once, with no
// selection and no digests (the decode side holds every block, so no selection needs them), and
// sent as one proactive unit. False when the layer takes the selective way (the caller queues its
// selection).
bool Context::commit_whole_layer(Transfer &t, uint32_t layer) {
    if (!(t.paths & SG_PATH_PROACTIVE)) return false;
    std::lock_guard lock(mu);
    Transfer::Layer &L = t.layers[layer];
    if (L.out.written) return false;
    const uint64_t now = now_ns();
    if (!stream_whole(t, t.sel.last_written_ns ? now - t.sel.last_written_ns : 0)) return false;
    L.out.written = true;
    L.out.written_ns = now;
    t.sel.last_written_ns = now;
    t.sel.layers_written++;
    queue_whole_layer(t, layer);
    if (t.matched() && !t.finished()) pump_selective(t, 1, plan::kTurnQuota);
    wake();
    return true;
}

void Context::commit_layer(Transfer &t, uint32_t layer, PreparedLayer &&prep) {
    Transfer::Layer &L = t.layers[layer];
    if (L.out.written) return;
    L.out.written = true;
    L.out.written_ns = now_ns();
    const uint64_t interval = t.sel.last_written_ns ? L.out.written_ns - t.sel.last_written_ns : 0;
    t.sel.last_written_ns = L.out.written_ns;
    t.sel.layers_written++;
    if (t.paths & SG_PATH_PROACTIVE) {
        L.out.selected = std::move(prep.selected);
        L.digests = std::move(prep.digests);
        // The proactive unit goes even when empty: its notice is what makes the layer essential.
        if (stream_whole(t, interval)) {
            queue_whole_layer(t, layer);
        } else {
            t.sel.proactive_queue.push_back(claim(t, layer, SG_PATH_PROACTIVE, L.out.selected));
        }
    }
    if (!L.out.demand_waiting.empty()) {
        auto u = claim(t, layer, SG_PATH_ON_DEMAND, L.out.demand_waiting);
        t.stats.fetch_blocks += u->blocks.size();
        if (!u->blocks.empty()) t.sel.demand_queue.push_back(std::move(u));
        L.out.demand_waiting.clear();
    }
    if (t.sel.layers_written == t.layers.size() && t.options.lease_ns)
        t.prefill.lease_deadline_ns = saturating_add(now_ns(), t.options.lease_ns);
}

// ---- prefill: posting units ----------------------------------------------------------------------

// Sends the Selective message that tells the decode side which paths this transfer runs; sent for
// every matched transfer so that the decode side can answer calls about paths the transfer lacks.
void Context::start_selective(Transfer &t) {
    if (t.selective() && t.pool->layout.tokens_per_block != t.prefill.dst->layout.tokens_per_block)
        fail(SG_ERR_LAYOUT_MISMATCH, "the selective paths need the same tokens_per_block on both sides (prefill " +
                                         std::to_string(t.pool->layout.tokens_per_block) + ", decode " +
                                         std::to_string(t.prefill.dst->layout.tokens_per_block) + ")");
    wire::Selective m;
    m.decode_xfer_id = t.id;
    m.paths = t.paths;
    std::vector<uint8_t> out;
    wire::encode(out, id, m);
    send(*t.session, out, &t);
}

SendUnit *Context::next_unit(Transfer &t, int pass) {
    if (pass == 0) return t.sel.demand_queue.empty() ? nullptr : t.sel.demand_queue.front().get();
    if (pass == 1) return t.sel.proactive_queue.empty() ? nullptr : t.sel.proactive_queue.front().get();
    if (!(t.paths & SG_PATH_SPECULATIVE)) return nullptr;
    if (t.session->last_fetch_ns && now_ns() - t.session->last_fetch_ns < kSpeculativeYieldNs) {
        // Paused, except for a unit already under way that holds blocks a fetch asked for.
        const bool urgent = !t.sel.speculative_queue.empty() && t.sel.speculative_queue.front()->urgent;
        return urgent ? t.sel.speculative_queue.front().get() : nullptr;
    }
    if (!t.sel.speculative_queue.empty()) return t.sel.speculative_queue.front().get();
    // Speculative units wait until every written layer's essential blocks are on their way.
    if (!t.sel.proactive_queue.empty()) return nullptr;
    const uint64_t per_block = block_bytes(t.pool->layout);
    const size_t max_blocks =
        std::min<size_t>(kMaxBlocksPerMessage, std::max<uint64_t>(1, kSpeculativeUnitBytes / per_block));
    std::vector<uint32_t> want;
    while (t.sel.spec_order_pos < t.prefill.order.size()) {
        const uint32_t layer = t.prefill.order[t.sel.spec_order_pos];
        Transfer::Layer &L = t.layers[layer];
        if (!L.out.written) return nullptr;  // layers go in send order
        const uint32_t nb = uint32_t(L.out.claimed.size());
        while (L.out.spec_cursor < nb && want.size() < max_blocks) {
            if (!L.out.claimed[L.out.spec_cursor]) want.push_back(L.out.spec_cursor);
            L.out.spec_cursor++;
        }
        if (!want.empty()) {
            t.sel.speculative_queue.push_back(claim(t, layer, SG_PATH_SPECULATIVE, want));
            return t.sel.speculative_queue.front().get();
        }
        t.sel.spec_order_pos++;
    }
    return nullptr;
}

void Context::compile_unit(Transfer &t, SendUnit &u) {
    u.compiled = true;
    const kv::Layout &L = t.pool->layout;
    Transfer::Layer &layer = t.layers[u.layer];
    if (u.path == SG_PATH_PROACTIVE && !layer.digests.empty()) {
        // The digests go first, in runs; the notice counts them so the decode side knows when all
        // have arrived, whatever order the provider completes them in.
        // Only blocks that can still be fetched: the unit's own blocks arrive with it, and the
        // decode side digests those from its copy of the keys (the same keys, so the same digests).
        const uint64_t per_block = digest_block_bytes(L);
        const uint32_t nb = request_blocks(t);
        const uint32_t run = uint32_t(std::max<uint64_t>(1, kDigestChunkBytes / per_block));
        auto in_unit = [&](uint32_t b) { return std::binary_search(u.blocks.begin(), u.blocks.end(), b); };
        for (uint32_t first = 0; first < nb;) {
            if (in_unit(first)) {
                ++first;
                continue;
            }
            uint32_t count = 1;
            while (count < run && first + count < nb && !in_unit(first + count)) ++count;
            wire::Digests m;
            m.decode_xfer_id = t.id;
            m.layer = u.layer;
            m.first_block = first;
            m.count = count;
            first += count;
            m.elem_bytes = L.elem_bytes;
            m.data.assign(layer.digests.begin() + ptrdiff_t(m.first_block * per_block),
                          layer.digests.begin() + ptrdiff_t((m.first_block + m.count) * per_block));
            std::vector<uint8_t> out;
            wire::encode(out, id, m);
            send(*t.session, out, &t, true);
            u.digest_chunks++;
            t.stats.digest_bytes += m.data.size();
            t.stats.bytes += m.data.size();
        }
        std::vector<uint8_t>().swap(layer.digests);
    }
    u.ops.clear();
    if (u.blocks.empty()) return;
    // Equal block sizes on both sides (checked at the match), so a subset of the request is a
    // request of its own: the blocks' ids on each side, with the last block partial only when it
    // is the request's last.
    std::vector<uint32_t> src_ids(u.blocks.size()), dst_ids(u.blocks.size());
    for (size_t i = 0; i < u.blocks.size(); ++i) {
        src_ids[i] = t.table[u.blocks[i]];
        dst_ids[i] = t.prefill.dst_table[u.blocks[i]];
    }
    const uint64_t last_first_token = uint64_t(u.blocks.back()) * L.tokens_per_block;
    const uint64_t tokens = uint64_t(u.blocks.size() - 1) * L.tokens_per_block +
                            std::min<uint64_t>(L.tokens_per_block, t.num_tokens - last_first_token);
    const uint32_t rpl = L.regions_per_layer();
    const uint8_t *bases[2] = {t.pool->region(u.layer, 0), t.pool->region(u.layer, rpl - 1)};
    plan::Side src{&L, src_ids};
    plan::Side dst{&t.prefill.dst->layout, dst_ids};
    plan::Limits limits;
    const uint64_t max_op = std::min(max_op_bytes_, t.session->tp->caps().max_msg_size);
    const transport::Capabilities &caps = t.session->tp->caps();
    const uint64_t spec_op = caps.bulk_apart || caps.local_only ? kApartSpeculativeOpBytes : kSpeculativeOpBytes;
    limits.max_op_bytes = u.path == SG_PATH_SPECULATIVE ? std::min(max_op, spec_op) : max_op;
    if (t.staged_only()) limits.max_op_bytes = std::min<uint64_t>(limits.max_op_bytes, StagingArea::kSlotBytes);
    limits.max_iov = uint32_t(std::min<uint64_t>(plan::kMaxIov, std::max<uint64_t>(1, t.session->tp->caps().rma_iov_limit)));
    const plan::LayerPlanStats ps = plan::compile_layer(src, bases, dst, tokens, limits, u.ops);
    t.stats.segments += ps.segments;
    u.bytes = ps.bytes;
    // Scattered blocks make small writes, each costly on a kernel TCP stack or a shared-memory
    // round trip: pack them through the staging slots, as the full path does for small layers.
    // Speculative bulk over tcp goes unpacked: there the kernel's copy is the cost, and packing and
    // unpacking it took from both sides the CPU a decode step needs (stall 300 -> 90 ms at 10
    // Gbit/s); shm pays a round trip per write, so it packs everything.
    const uint64_t mean = u.ops.empty() ? 0 : ps.bytes / u.ops.size();
    const bool pack_bulk = t.session->tp->caps().local_only;
    u.staged = t.staged_only() || // quantized or copied off the device while packing
               (t.session->have_peer_staging &&
                ((u.path != SG_PATH_SPECULATIVE || pack_bulk) && staging_policy_ != SG_STAGING_NEVER &&
                 (staging_policy_ == SG_STAGING_ALWAYS || (staging_threshold_ && mean < staging_threshold_))));
}

void Context::count_unit_bytes(Transfer &t, const SendUnit &u, uint64_t wire_len, uint64_t payload_len) {
    if (u.path == SG_PATH_SPECULATIVE) t.session->speculative_inflight += wire_len;
    if (u.path == SG_PATH_PROACTIVE) t.session->proactive_inflight += wire_len;
    (u.path == SG_PATH_ON_DEMAND     ? t.stats.bytes_on_demand
     : u.path == SG_PATH_PROACTIVE   ? t.stats.bytes_proactive
                                     : t.stats.bytes_speculative) += payload_len;
}

// The other side of count_unit_bytes' in-flight counts: a write completed or was dropped unposted.
void Context::uncount_inflight(Session &s, const SendUnit &u, uint64_t len) {
    if (u.path == SG_PATH_SPECULATIVE) s.speculative_inflight -= len;
    if (u.path == SG_PATH_PROACTIVE) s.proactive_inflight -= len;
}

// Posts up to `quota` writes of the transfer's units of one pass (0 on-demand, 1 proactive,
// 2 speculative); returns whether it posted any.
bool Context::pump_selective(Transfer &t, int pass, uint32_t quota) {
    if (!t.matched() || t.finished()) return false;
    flush_outbox(*t.session);
    Session &s = *t.session;
    uint32_t posted = 0;
    auto &queue = pass == 0 ? t.sel.demand_queue : pass == 1 ? t.sel.proactive_queue : t.sel.speculative_queue;
    // Proactive writes' bound for this call (the context's mutex is held: neither a written layer nor
    // a fetch can come in meanwhile).
    const bool apart = s.tp->caps().bulk_apart;
    // (A transfer whose every layer went whole gives decode nothing to fetch.)
    const bool decode_may_fetch =
        (t.sel.layers_written == t.layers.size() && t.sel.layers_whole < t.layers.size()) ||
        (s.last_fetch_ns && now_ns() - s.last_fetch_ns < kSpeculativeYieldNs);
    const uint64_t proactive_bound = decode_may_fetch ? kProactiveFetchFriendlyBytes : kProactiveInflightBytes;
    const uint64_t speculative_bound = apart                      ? kApartSpeculativeInflightBytes
                                       : s.tp->caps().local_only ? kLocalSpeculativeInflightBytes
                                                                 : kSpeculativeInflightBytes;
    while (posted < quota) {
        SendUnit *u = next_unit(t, pass);
        if (!u) break;
        if (!u->compiled) compile_unit(t, *u);
        while (u->next_op < u->ops.size() && budget_.has_op_slot() && posted < quota) {
            const uint64_t len = u->ops[u->next_op].len;
            // On-demand writes only wait for operation slots; bulk respects the byte bounds, and
            // speculative bulk its own small bound on top.
            if (pass >= 1 && !may_post_bytes(s, len)) break;
            if (pass == 2 && s.speculative_inflight && s.speculative_inflight + len > speculative_bound) break;
            if (pass == 1 && s.proactive_inflight && s.proactive_inflight + len > proactive_bound) break;
            if (!(u->staged ? post_staged_chunk(t, u->layer, u->ops, u->next_op, u)
                             : post_write_op(t, u->layer, u->ops, u->next_op, u)))
                break;
            posted++;
        }
        if (!u->fully_posted()) break;
        t.sel.posted_units.push_back(std::move(queue.front()));
        queue.pop_front();
    }
    selective_notices(t);
    return posted > 0;
}

// Sends the notice of every posted unit whose writes are delivered (or ordered before the notice),
// records delivered units, and ends the transfer once every block of every layer is delivered.
void Context::selective_notices(Transfer &t) {
    if (t.finished() || !t.matched()) return;
    const bool saw = t.session->tp->caps().send_after_write;
    for (size_t i = 0; i < t.sel.posted_units.size();) {
        SendUnit &u = *t.sel.posted_units[i];
        if (!u.notice_sent && u.packs_pending == 0 && (saw || u.outstanding == 0)) {
            for (size_t first = 0; first < std::max<size_t>(1, u.blocks.size()); first += kMaxBlocksPerMessage) {
                wire::BlocksReady m;
                m.decode_xfer_id = t.id;
                m.layer = u.layer;
                m.path = u.path;
                const size_t end = std::min(u.blocks.size(), first + kMaxBlocksPerMessage);
                m.blocks.assign(u.blocks.begin() + ptrdiff_t(std::min(first, u.blocks.size())), u.blocks.begin() + ptrdiff_t(end));
                m.bytes = u.blocks.empty() ? 0 : u.bytes * m.blocks.size() / u.blocks.size();
                // The last notice of a proactive unit makes the layer essential once the digests it
                // counts have arrived.
                const bool last = end == u.blocks.size();
                m.digest_chunks = last ? u.digest_chunks : 0;
                m.essential = last && u.path == SG_PATH_PROACTIVE;
                m.staged_chunks = t.layers[u.layer].staged_chunks;
                std::vector<uint8_t> out;
                wire::encode(out, id, m);
                send(*t.session, out, &t);
            }
            u.notice_sent = true;
        }
        if (!u.notice_sent || u.outstanding) {
            ++i;
            continue;
        }
        Transfer::Layer &L = t.layers[u.layer];
        for (uint32_t b : u.blocks) t.residency.set(u.layer, b);
        L.out.delivered_count += uint32_t(u.blocks.size());
        if (u.path == SG_PATH_SPECULATIVE) note_bulk_delivered(*t.session, u.bytes);
        if (u.path == SG_PATH_PROACTIVE) {
            L.essential = true;
            emit(t, SG_EVENT_ESSENTIAL_READY, u.layer, SG_OK);
        }
        if (L.out.delivered_count == L.out.claimed.size() && !L.ready) mark_ready(t, u.layer);
        t.sel.posted_units.erase(t.sel.posted_units.begin() + ptrdiff_t(i));
        cv.notify_all();
    }
    if (t.stats.layers_ready == t.layers.size()) send_done(t);
}

void Context::on_fetch(Session &s, wire::Fetch &m) {
    auto p = s.posts.find(m.request_id);
    if (p == s.posts.end() || p->second->id != m.decode_xfer_id) return;  // released meanwhile
    Transfer &t = *p->second;
    if (t.finished()) return;  // the decode side learns the status from the transfer
    // A peer whose values fail these checks loses its session, like any other range check of what
    // a peer sends (STYLE 25); its transfers end with SG_ERR_PROTOCOL.
    if (!(t.paths & SG_PATH_ON_DEMAND)) fail(SG_ERR_PROTOCOL, "the decode side fetched blocks without SG_PATH_ON_DEMAND");
    const uint32_t nb = request_blocks(t);
    if (m.layer >= t.layers.size()) fail(SG_ERR_PROTOCOL, "Fetch names a layer that does not exist");
    for (uint32_t b : m.blocks)
        if (b >= nb) fail(SG_ERR_PROTOCOL, "Fetch names a block beyond the request's block table");
    t.stats.fetch_requests++;
    s.last_fetch_ns = now_ns();
    Transfer::Layer &L = t.layers[m.layer];
    if (!L.out.written) {
        // Served as soon as the engine has written the layer.
        // Kept as a set of the request's blocks, so repeated fetches cannot grow it.
        auto &w = L.out.demand_waiting;
        w.insert(w.end(), m.blocks.begin(), m.blocks.end());
        std::sort(w.begin(), w.end());
        w.erase(std::unique(w.begin(), w.end()), w.end());
        return;
    }
    release_unposted_speculative(t, m.layer, m.blocks);
    auto u = claim(t, m.layer, SG_PATH_ON_DEMAND, m.blocks);
    t.stats.fetch_blocks += u->blocks.size();
    if (u->blocks.empty()) return;  // all on their way already
    t.sel.demand_queue.push_back(std::move(u));
    pump_selective(t, 0, budget_.max_ops);
    wake();
}

}  // namespace sg::core
