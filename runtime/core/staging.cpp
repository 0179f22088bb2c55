// Staging: a session's pack and receive slots, packing small operations into one write and
// unpacking them on the other side, and the policy that chooses per layer between plain writes
// and staging from the throughput each achieved on the session.
#include "core/core.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace sg::core {

namespace {

// Keeps a chunk notice (20 bytes a segment) well inside one receive buffer.
constexpr size_t kMaxSegmentsPerChunk = 4096;

}  // namespace

void StagingArea::allocate() {
    void *p = ::mmap(nullptr, kSlots * kSlotBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail(SG_ERR_NO_MEMORY, "mmap of the staging area failed");
    base = static_cast<uint8_t *>(p);
}

void StagingArea::release(transport::Transport *tp) noexcept {
    if (reg.mr && tp) tp->deregister(reg);
    if (base) ::munmap(base, kSlots * kSlotBytes);
    base = nullptr;
}

// Decode side, before its first Expect on the session: the receive slots the peer may stage into,
// and where they are (a HandleExport ahead of the Expect, so the peer knows them by the time it
// matches). Allocated and registered once per session, only by sessions that expect.
void Session::offer_staging() {
    if (recv_staging.base) return;
    recv_staging.allocate();
    try {
        recv_staging.reg =
            tp->register_memory(recv_staging.base, StagingArea::kSlots * StagingArea::kSlotBytes, random_u64());
    } catch (...) {
        recv_staging.release(tp);
        throw;
    }
    wire::HandleExport ex;
    ex.handle_id = StagingArea::kHandleId;
    // Described as a pool of opaque 4 KiB blocks so the descriptor passes the same checks as a KV
    // pool's (fp8, one fused block = two 2 KiB planes).
    ex.regions_per_layer = 1;
    ex.layout.num_layers = 1;
    ex.layout.num_kv_heads = 1;
    ex.layout.head_dim = 2048;
    ex.layout.tokens_per_block = 1;
    ex.layout.dtype = SG_DTYPE_FP8_E4M3;
    ex.layout.packing = SG_KV_FUSED;
    ex.layout.block_stride_bytes = 4096;
    ex.layout.num_blocks = StagingArea::kSlots * StagingArea::kSlotBytes / 4096;
    ex.regions.push_back({recv_staging.reg.key, recv_staging.reg.remote_base, StagingArea::kSlots * StagingArea::kSlotBytes});
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, ex);
    send(out);
}

// Prefill side, at the first staged chunk: the slots we pack into. False when they cannot be had
// (the layer then goes as plain writes).
bool Session::ensure_send_staging() {
    if (send_staging.base) return true;
    try {
        send_staging.allocate();
        if (tp->caps().needs_local_desc)
            send_staging.reg =
                tp->register_memory(send_staging.base, StagingArea::kSlots * StagingArea::kSlotBytes, random_u64());
        return true;
    } catch (const Error &e) {
        send_staging.release(tp);
        have_peer_staging = false;
        ctx->log.log(SG_LOG_WARN, "staging turned off for this session: " + e.message());
        return false;
    }
}

// Per-operation cost differs by provider and machine (tcp: kernel copies dominate, staging adds
// two memcpys; shm: every operation is a round trip, staging wins by far). A same-host provider
// stages every candidate layer; elsewhere the path is chosen by the throughput each achieved on this
// session: each unmeasured path is tried first, and the slower one is retried every 8th candidate
// layer (every 32nd when it lost by 25% or more) so a change in conditions is noticed.
bool Session::choose_staging() {
    const uint32_t n = candidate_layers++;
    // A same-host provider with no connection to share (shm) pays a round trip through the peer for
    // every plain write, so for a candidate layer (small operations) staging wins by far, and a
    // probe of plain writes is only cost: measured rates under concurrency do not say so reliably
    // (a staged layer's time includes waiting for a slot), and an outside user's 16 threads on one
    // shm session moved 3.4x less under the measuring policy than with staging forced.
    if (tp->caps().local_only) return true;
    if (path_rate[0] == 0 || path_rate[1] == 0) {
        // One probe at a time per unmeasured path: when many transfers start at once they must not
        // all go down a path nobody has measured (16 threads on one shm session all went direct,
        // where every operation is a round trip through the peer, and moved 23 MiB/s against 1.4
        // GiB/s staged). The rest take the better guess until the probes report.
        const uint64_t now = now_ns();
        for (int path : {0, 1})
            if (path_rate[path] == 0 && now - probe_ns[path] > ctx->kProbeSpacingNs) {
                probe_ns[path] = now;
                return path == 1;
            }
        // Plain writes avoid copies: the better guess until the probes report.
        return false;
    }
    const bool faster = path_rate[1] > path_rate[0];
    // A close call is questioned every 8th layer. A clear winner is questioned less often the
    // clearer it is, so that re-measuring the loser costs at most ~1/8 of the time saved: at 25%
    // every 32nd layer, and a path 100 times slower (direct writes over shm) every 800th, never
    // rarer than every 4096th.
    const double margin = faster ? path_rate[1] / path_rate[0] : path_rate[0] / path_rate[1];
    const uint32_t every = margin < 1.25 ? 8 : uint32_t(std::clamp(8.0 * margin, 32.0, 4096.0));
    return n % every == every - 1 ? !faster : faster;
}

void Transfer::record_layer_rate(Transfer::Layer &L) {
    if (!L.out.candidate || ctx->staging_policy_ != SG_STAGING_AUTO) return;
    const uint64_t ns = std::max<uint64_t>(1, now_ns() - L.out.start_ns);
    const double rate = double(L.out.bytes) / double(ns);
    double &r = session->path_rate[L.out.staged ? 1 : 0];
    r = r == 0 ? rate : 0.5 * r + 0.5 * rate;
}

// Reserves a staging slot on each side for as many of the layer's remaining ops as fit and counts
// them as one write in flight; the packing (up to a slot's 4 MiB) and the write happen in
// run_packs, outside the context's mutex. unit: the selective send unit the ops belong to (NULL:
// the full path's current layer).
bool Transfer::post_staged_chunk(uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit) {
    Session &s = *session;
    if (ctx->tx_full(*s.tp)) return false;  // the provider is full: a packed chunk would only wait
    // Device memory the provider cannot reach cannot go as a plain write: without slots on both
    // sides the transfer fails.
    if (!s.have_peer_staging || !s.ensure_send_staging()) {
        if (rma_reaches_both_pools()) return post_write_op(layer, ops, next_op, unit);
        fail_with(SG_ERR_UNSUPPORTED,
                      "a pool in device memory moves through staging slots, and this session has none", true);
        return false;
    }
    if (!s.free_peer_slots || !s.free_send_slots) return false;
    PackJob p;
    p.checked = s.peer_minor >= 7;
    p.rslot = uint32_t(__builtin_ctz(s.free_peer_slots));
    p.lslot = uint32_t(__builtin_ctz(s.free_send_slots));
    wire::StagedChunk chunk;
    chunk.decode_xfer_id = id;
    chunk.layer = layer;
    chunk.slot = p.rslot;
    const size_t first = next_op;
    size_t k = first;
    p.src_device = pool->layout.mem_kind == SG_MEM_CUDA ? pool->layout.device : -1;
    for (; k < ops.size() && chunk.segments.size() < kMaxSegmentsPerChunk; ++k) {
        const plan::Op &op = ops[k];
        uint64_t wire_len = op.len;
        PackJob::QuantSegment q{op.niov, op.dst_region, op.dst_offset, op.len, {}};
        // A quantized transfer's range that is not whole head rows (padding coalesced between
        // blocks) travels raw, in a chunk of raw ranges: a chunk is quantized or not as a whole.
        const bool quantized =
            options.wire_quant &&
            quant::shape_of(prefill().dst->layout, op.dst_region, op.dst_offset, op.len, q.shape);
        if (k == first)
            p.wire_quant = chunk.wire_quant = quantized ? options.wire_quant : 0;
        else if (quantized != (p.wire_quant != 0))
            break;
        if (quantized) wire_len = q.shape.wire_bytes();
        if (p.used + wire_len > StagingArea::kSlotBytes) {
            if (k > first) break;
            if (rma_reaches_both_pools()) return post_write_op(layer, ops, next_op, unit);  // larger than a slot
            fail_with(SG_ERR_INTERNAL, "an operation larger than a staging slot on a device transfer", true);
            return false;
        }
        for (uint32_t i = 0; i < op.niov; ++i) p.pieces.emplace_back(op.iov[i].addr, op.iov[i].len);
        p.used += wire_len;
        p.payload += op.len;
        if (p.wire_quant) p.quant_segments.push_back(q);
        chunk.segments.push_back({layer * prefill().dst->regions_per_layer + op.dst_region, op.dst_offset, op.len});
    }
    p.chunk = std::move(chunk);
    p.variant = &staging_variant(p.src_device >= 0, p.wire_quant != 0);
    p.t = shared_from_this();
    p.layer = layer;
    p.unit = unit;
    ctx->budget_.posted(p.used);
    s.bytes_inflight += p.used;
    s.free_peer_slots &= ~(1u << p.rslot);
    s.free_send_slots &= ~(1u << p.lslot);
    inflight++;
    if (unit) {
        unit->outstanding++;
        unit->packs_pending++;
        count_unit_bytes(*unit, p.used, p.payload);
    } else {
        layers[layer].out.outstanding++;
        layers[layer].out.packs_pending++;
    }
    stats.rma_ops++;
    stats.bytes += p.payload;
    stats.staged_bytes += p.payload;
    stats.staging_copies += p.pieces.size();
    if (p.wire_quant) {
        stats.quantized_bytes += p.payload;
        stats.quantized_wire_bytes += p.used;
    }
    ctx->counters.rma_ops++;
    ctx->counters.bytes_staged += p.used;
    ctx->counters.staging_copies += p.pieces.size();
    next_op = k;
    ctx->packs_.push_back(std::move(p));
    ctx->wake();
    return true;
}

void Context::run_copies(std::unique_lock<std::mutex> &lock) {
    run_packs(lock);
    run_unpacks(lock);
}

void Context::run_packs(std::unique_lock<std::mutex> &lock) {
    if (packs_.empty() || packing_) return;
    std::deque<PackJob> batch;
    batch.swap(packs_);
    packing_ = true;
    lock.unlock();
    for (PackJob &p : batch) {
        // A transfer that ended meanwhile sends nothing more; its reservation is given back below.
        if (p.packed || p.t->finished()) continue;
        uint8_t *slot = p.t->session->send_staging.base + size_t(p.lslot) * StagingArea::kSlotBytes;
        try {
            p.variant->pack(p, slot);
        } catch (const Error &e) {
            p.error = e.message();
            p.error_status = e.status();
        }
        p.packed = true;
    }
    lock.lock();
    packing_ = false;
    std::deque<PackJob> waiting;  // the provider was full: retried on a later pass, in order
    for (PackJob &p : batch) {
        if (!p.error.empty() && !p.t->finished()) p.t->fail_with(p.error_status, p.error, true);
        if (p.t->finished() || p.t->session->closed()) {
            drop_pack(p);
        } else if (!waiting.empty() || !post_pack(p)) {
            waiting.push_back(std::move(p));
        }
    }
    // Chunks reserved while this batch was copied go after the ones still waiting for the provider.
    for (PackJob &p : packs_) waiting.push_back(std::move(p));
    packs_.swap(waiting);
}

// Tried even while the provider's queue was lately full (tx_full): a chunk reserved before the
// writes that filled it keeps its place instead of waiting behind every later write.
bool Context::post_pack(PackJob &p) {
    Transfer &t = *p.t;
    Session &s = *t.session;
    const wire::Region &peer_area = s.peer_staging.regions[0];
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::StagedWrite;
    c->xfer = &t;
    c->session = &s;
    c->layer = p.layer;
    c->unit = p.unit;
    c->staging_slot = p.lslot;
    c->len = p.used;
    transport::LocalIov iov{s.send_staging.base + size_t(p.lslot) * StagingArea::kSlotBytes, p.used, s.send_staging.reg.desc};
    int rc;
    try {
        rc = s.tp->post_write_as(write_class(p.unit), s.peer, std::span(&iov, 1),
                                 peer_area.base + p.rslot * StagingArea::kSlotBytes, peer_area.key, c);
    } catch (const Error &e) {
        give_cookie(c);
        s.lose(SG_ERR_PEER_LOST, "writing to the peer failed: " + e.message());
        drop_pack(p);
        return true;  // settled: nothing left to retry
    }
    if (rc == -EAGAIN) {
        give_cookie(c);
        note_tx_full(*s.tp);
        return false;
    }
    t.layers[p.layer].staged_chunks++;
    // The generation counts writes handed to the provider: one whose write fails sends no notice,
    // and the peer sees the next generation skip it (it only has to grow).
    uint32_t &generation = s.peer_slot_generation[p.rslot];
    generation = wire::next_generation(generation);
    p.chunk.generation = generation;
    p.chunk.crc32c = p.crc;
    std::vector<uint8_t> notice;
    wire::encode(notice, id, p.chunk);
    if (s.tp->caps().send_after_write) {
        s.send(notice, &t);
    } else {
        c->bytes.assign(notice.begin(), notice.end());  // sent when the write completes
    }
    SG_ASSERT((p.unit ? p.unit->packs_pending : t.layers[p.layer].out.packs_pending) > 0,
              "transfer '" + t.request_id + "': a pack handed over twice");
    if (p.unit) {
        p.unit->packs_pending--;
        t.selective_notices();
    } else {
        t.layers[p.layer].out.packs_pending--;
        t.maybe_send_notices();
    }
    return true;
}

void Context::drop_pack(PackJob &p) {
    Transfer &t = *p.t;
    Session &s = *t.session;
    budget_.completed(p.used);
    s.bytes_inflight -= p.used;
    s.free_peer_slots |= 1u << p.rslot;  // never written
    s.free_send_slots |= 1u << p.lslot;
    SG_ASSERT(t.inflight > 0 && (p.unit ? p.unit->packs_pending : t.layers[p.layer].out.packs_pending) > 0,
              "transfer '" + t.request_id + "': a pack dropped that was never reserved");
    t.inflight--;
    if (p.unit) {
        p.unit->outstanding--;
        p.unit->packs_pending--;
        s.uncount_inflight(*p.unit, p.used);
    } else {
        t.layers[p.layer].out.outstanding--;
        t.layers[p.layer].out.packs_pending--;
    }
    t.stats.rma_ops--;
    t.stats.bytes -= p.payload;
    t.stats.staged_bytes -= p.payload;
    if (p.wire_quant) {
        t.stats.quantized_bytes -= p.payload;
        t.stats.quantized_wire_bytes -= p.used;
    }
    counters.rma_ops--;
    counters.bytes_staged -= p.used;
    if (s.closed() && !s.regs_dropped) s.drop_registrations();
    t.maybe_send_quiesced();
    t.note_quiesced();
}

void Session::on_staged_chunk(wire::StagedChunk &m) {
    if (m.slot >= StagingArea::kSlots) fail(SG_ERR_PROTOCOL, "StagedChunk names a slot that does not exist");
    if (!recv_staging.base) fail(SG_ERR_PROTOCOL, "StagedChunk on a session that offered no staging slots");
    // A slot is written again only after we credited it, so each notice of a slot follows the
    // last: one whose generation did not grow (a notice sent twice, or one for a write we already
    // unpacked) describes bytes that are no longer there. The wrap from 2^32-1 to 1 is the one step
    // down a peer may take.
    if (m.generation) {
        uint32_t &last = recv_slot_generation[m.slot];
        if (!wire::generation_grew(last, m.generation))
            fail(SG_ERR_PROTOCOL, "StagedChunk for slot " + std::to_string(m.slot) + " with generation " +
                                      std::to_string(m.generation) + " after generation " + std::to_string(last));
        last = m.generation;
    }
    if (Transfer *running = running_expect(m.decode_xfer_id)) {
        Transfer &t = *running;
        const kv::Layout &L = t.pool->layout;
        uint64_t pos = m.slot_offset;
        // Quantized chunks come only for a transfer both sides agreed to quantize, in its code.
        if (m.wire_quant && m.wire_quant != t.options.wire_quant)
            fail(SG_ERR_PROTOCOL, std::string("StagedChunk quantized as ") + quant::name_of(m.wire_quant) +
                                      " for a transfer expected with wire_quant " +
                                      quant::name_of(t.options.wire_quant));
        // The peer is trusted with the keys of this pool, not with our address space: every
        // segment must fall inside the slot and inside the pool's region. All are checked
        // before the first byte is copied.
        std::vector<quant::Shape> shapes;
        if (m.wire_quant) shapes.reserve(m.segments.size());
        for (const wire::Segment &seg : m.segments) {
            const uint32_t layer = seg.region / L.regions_per_layer();
            // A quantized segment takes at least a byte per element of the slot: that bound is checked
            // before its rows are walked, so a hostile length costs nothing.
            const uint64_t least = m.wire_quant ? seg.length / std::max<uint64_t>(1, L.elem_bytes) : seg.length;
            if (layer >= L.num_layers || !in_bounds(seg.offset, seg.length, L.region_bytes()) ||
                !in_bounds(pos, least, StagingArea::kSlotBytes))
                fail(SG_ERR_PROTOCOL, "StagedChunk segment outside the pool or the staging slot");
            uint64_t wire_len = seg.length;
            if (m.wire_quant) {
                quant::Shape &shape = shapes.emplace_back();
                if (!quant::shape_of(L, seg.region % L.regions_per_layer(), seg.offset, seg.length, shape))
                    fail(SG_ERR_PROTOCOL, "quantized StagedChunk segment is not whole head rows of the pool");
                wire_len = shape.wire_bytes();
                if (!in_bounds(pos, wire_len, StagingArea::kSlotBytes))
                    fail(SG_ERR_PROTOCOL, "StagedChunk segment outside the pool or the staging slot");
            }
            pos += wire_len;
        }
        // The copy happens outside mu (run_unpacks); the slot stays ours until its credit goes.
        t.decode().unpacks_pending++;
        const StagingVariant &variant = staging_variant(L.mem_kind == SG_MEM_CUDA, m.wire_quant != 0);
        ctx->unpacks_.push_back({t.shared_from_this(), &variant, std::move(m), std::move(shapes)});
        ctx->wake();
        return;
    }
    wire::StagingCredit credit;
    credit.slot = m.slot;
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, credit);
    send(out);
}

void Context::run_unpacks(std::unique_lock<std::mutex> &lock) {
    if (unpacks_.empty() || unpacking_) return;
    std::vector<UnpackJob> batch;
    batch.swap(unpacks_);
    unpacking_ = true;
    lock.unlock();
    for (UnpackJob &u : batch) {
        // A transfer that ended meanwhile needs no bytes; its blocks are not reused before the
        // pending count is back to 0 either way.
        if (u.t->finished()) continue;
        try {
            const StagingArea &area = u.t->session->recv_staging;
            u.variant->unpack(u, area.base + size_t(u.chunk.slot) * StagingArea::kSlotBytes + u.chunk.slot_offset);
        } catch (const Error &e) {
            u.error = e.message();
            u.error_status = e.status();
        }
    }
    lock.lock();
    unpacking_ = false;
    for (UnpackJob &u : batch) {
        if (!u.error.empty() && !u.t->finished()) {
            if (u.error_status == SG_ERR_TRANSPORT) log.log(SG_LOG_WARN, u.error);
            u.t->fail_with(u.error_status, u.error, true);
        }
        finish_unpack(u);
    }
    if (!unpacks_.empty()) wake();
}

// With mu: the chunk is in place (or its transfer ended): count it, let the layer's notices that
// waited for it apply, and give the slot back to the peer.
void Context::finish_unpack(UnpackJob &u) {
    Transfer &t = *u.t;
    Session &s = *t.session;
    const wire::StagedChunk &m = u.chunk;
    SG_ASSERT(t.decode().unpacks_pending > 0, "transfer '" + t.request_id + "': an unpack finished twice");
    t.decode().unpacks_pending--;
    if (!t.finished()) {
        for (const wire::Segment &seg : m.segments) {
            counters.staging_copies++;
            t.stats.staging_copies++;
            t.stats.staged_bytes += seg.length;
            if (m.wire_quant) t.stats.quantized_bytes += seg.length;
        }
        t.stats.quantized_wire_bytes += u.wire_bytes;
        if (m.layer < t.layers.size()) {
            t.layers[m.layer].staged_chunks++;
            t.path().chunk_landed(t, m.layer);
        }
    }
    t.note_quiesced();
    wire::StagingCredit credit;
    credit.slot = m.slot;
    std::vector<uint8_t> out;
    wire::encode(out, id, credit);
    s.send(out);
    cv.notify_all();
}

void Session::on_staging_credit(wire::StagingCredit &m) {
    if (m.slot < StagingArea::kSlots) free_peer_slots |= 1u << m.slot;
}

}  // namespace sg::core
