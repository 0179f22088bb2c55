// One side of one session (session.hpp). Both sides derive every transfer's spec from (seed, session,
// n), so they agree on sizes, paths and cancels without talking; the only coordination is HELLO at
// session start and "GO n" after a cancel that must precede the peer's post/expect.
#include "session.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace soak {

namespace {
const char *side_name(bool prefill) { return prefill ? "prefill" : "decode"; }
}  // namespace

void SideRunner::notify(const std::string &msg) {
    sg_status_t st = sg_session_notify(sess_, msg.data(), msg.size());
    if (st == SG_ERR_PEER_LOST) lost_ = true;
}

void SideRunner::poll_notifications() {
    char buf[SG_NOTIFY_MAX + 1];
    size_t len = 0;
    while (sg_session_next_notification(sess_, buf, SG_NOTIFY_MAX, &len) == SG_OK) {
        buf[len] = 0;
        unsigned long long n = 0;
        if (std::sscanf(buf, "GO %llu", &n) == 1)
            gos_.insert(n);
        else if (std::strcmp(buf, "FIN") == 0)
            peer_fin_ = true;
        else
            hellos_.push_back(buf);
    }
}

sg_status_t SideRunner::wait_go(uint64_t n) {
    const uint64_t deadline = now_ns() + uint64_t(cfg_.wait_s) * kSecond;
    for (;;) {
        poll_notifications();
        if (gos_.erase(n)) return SG_OK;
        sg_status_t se = SG_OK;
        sg_session_error(sess_, &se, nullptr, 0);
        if (se != SG_OK) return se;
        if (now_ns() > deadline) return SG_ERR_TIMEOUT;
        sleep_ms(1);
    }
}

sg_status_t SideRunner::health() {
    poll_notifications();
    sg_status_t se = SG_OK;
    sg_session_error(sess_, &se, nullptr, 0);
    return se;
}

sg_status_t SideRunner::finish_handshake() {
    sg_status_t st = sg_session_notify(sess_, "FIN", 3);
    if (st != SG_OK) return st;
    const uint64_t deadline = now_ns() + uint64_t(cfg_.wait_s) * kSecond;
    for (;;) {
        sg_status_t se = health();
        if (peer_fin_) return SG_OK;
        if (se != SG_OK) return se;
        if (now_ns() > deadline) return SG_ERR_TIMEOUT;
        sleep_ms(1);
    }
}

bool SideRunner::hello(sg_session_t sess, uint64_t &next_n, std::string *why) {
    sess_ = sess;
    lost_ = broken_ = peer_fin_ = false;
    gos_.clear();
    hellos_.clear();
    for (auto &p : pools_) {
        sg_status_t st = sg_session_export_kv(sess, p.handle);
        if (st != SG_OK) {
            *why = std::string("sg_session_export_kv: ") + sg_status_str(st) + ": " + sg_last_error_message();
            return false;
        }
    }
    char msg[96];
    std::snprintf(msg, sizeof msg, "HELLO %llx %llu", (unsigned long long)skey_, (unsigned long long)next_n);
    sg_status_t st = sg_session_notify(sess, msg, std::strlen(msg));
    if (st != SG_OK) {
        *why = std::string("HELLO notify: ") + sg_status_str(st);
        return false;
    }
    const uint64_t deadline = now_ns() + uint64_t(cfg_.wait_s) * kSecond;
    while (hellos_.empty()) {
        poll_notifications();
        sg_status_t se = SG_OK;
        char detail[256] = "";
        sg_session_error(sess, &se, detail, sizeof detail);
        if (se != SG_OK && hellos_.empty()) {
            *why = std::string("waiting for HELLO: ") + sg_status_str(se) + ": " + detail;
            return false;
        }
        if (now_ns() > deadline) {
            *why = "no HELLO from the peer within the wait";
            return false;
        }
        if (hellos_.empty()) sleep_ms(1);
    }
    unsigned long long key = 0, n = 0;
    if (std::sscanf(hellos_.front().c_str(), "HELLO %llx %llu", &key, &n) != 2 || key != skey_) {
        *why = "cross-wired session: peer said '" + hellos_.front() + "'";
        return false;
    }
    hellos_.pop_front();
    next_n = std::max<uint64_t>(next_n, n);
    return true;
}

std::string SideRunner::xfer_detail(sg_transfer_t x, sg_status_t st) {
    std::string d = sg_status_str(st);
    if (x) {
        char msg[512] = "";
        sg_status_t s2 = SG_OK;
        if (sg_transfer_status(x, &s2, msg, sizeof msg) == SG_OK && msg[0]) d += std::string(": ") + msg;
    }
    return d;
}

void SideRunner::report(const Active &a, sg_status_t st, uint64_t bytes, const std::string &detail) {
    const char *out;
    if (st == SG_ERR_PEER_LOST && loss_expected_) {
        out = "lost";
        lost_ = true;
    } else if (!detail.empty()) {
        out = "bad";  // a wrong byte, a hang, or a status the spec does not allow
    } else if (st == SG_OK) {
        out = "ok";
    } else if (st == SG_ERR_CANCELED && a.sp.cancel != Cancel::None) {
        out = "canceled";
    } else {
        out = "bad";
    }
    char line[160];
    std::snprintf(line, sizeof line, "T %d %llu %s %s %llu", session_, (unsigned long long)a.n, side_name(prefill_),
                  out, (unsigned long long)bytes);
    emit_(line);
    if (std::strcmp(out, "bad") == 0) {
        ++bad_;
        char head[512];
        Spec sp = a.sp;
        std::snprintf(head, sizeof head,
                      "E %d %llu %s seed=%llu req=%s kind=%d tokens=%llu paths=0x%x cancel=%s all_written=%d: ",
                      session_, (unsigned long long)a.n, side_name(prefill_), (unsigned long long)cfg_.seed,
                      request_id(skey_, a.n).c_str(), sp.kind, (unsigned long long)sp.tokens, sp.paths,
                      cancel_name(sp.cancel), int(sp.all_written));
        emit_(std::string(head) + (detail.empty() ? xfer_detail(a.x, st) : detail));
        // A failure that took the session with it ends the session; otherwise carry on.
        sg_status_t se = SG_OK;
        sg_session_error(sess_, &se, nullptr, 0);
        if (se == SG_ERR_PEER_LOST)
            lost_ = true;
        else if (se != SG_OK)
            broken_ = true;
    }
}

// ---- start: fill/poison, post/expect, cancels before the match -------------------------------------
void SideRunner::start(Active &a) {
    a.sp = make_spec(cfg_, skey_, a.n);
    Pool &p = pools_[a.sp.kind];
    a.table = block_table(cfg_, p, a.sp, skey_, a.n, prefill_);
    const uint32_t layers = p.layout.num_layers;
    a.order.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) a.order[l] = l;
    if (a.sp.shuffle_layers) {
        Rng r(mix(cfg_.seed, skey_, a.n, 3));
        for (size_t i = layers; i > 1; --i) std::swap(a.order[i - 1], a.order[r.below(i)]);
    }
    const std::string rid = request_id(skey_, a.n);
    sg_error_info_t err;
    sg_error_info_init(&err);
    auto fail = [&](sg_status_t st, const std::string &what) {
        a.start_status = st;
        a.start_detail = what + ": " + sg_status_str(st) + (err.message[0] ? std::string(": ") + err.message : "");
    };

    if (!prefill_) {
        poison(p, a.table);
        if (a.sp.cancel == Cancel::PrefillBefore) {
            sg_status_t st = wait_go(a.n);
            if (st != SG_OK) return fail(st, "waiting for the peer's cancel");
        }
        sg_status_t st = sg_transfer_expect(sess_, rid.c_str(), p.handle, a.table.data(), a.table.size(), a.sp.tokens,
                                            nullptr, &a.x, &err);
        if (st != SG_OK) return fail(st, "sg_transfer_expect");
        if (a.sp.cancel == Cancel::DecodeBefore) {
            sg_transfer_cancel(a.x);
            notify("GO " + std::to_string(a.n));
        }
        return;
    }

    if (a.sp.all_written)
        for (uint32_t l = 0; l < layers; ++l) fill_layer(p, a.sp, a.table, l);
    if (a.sp.cancel == Cancel::DecodeBefore) {
        sg_status_t st = wait_go(a.n);
        if (st != SG_OK) return fail(st, "waiting for the peer's cancel");
    }
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.paths = a.sp.paths;
    o.flags = a.sp.all_written ? SG_TRANSFER_ALL_LAYERS_WRITTEN : 0;
    o.priority = a.sp.priority;
    if (a.sp.shuffle_layers) {
        o.layer_order = a.order.data();
        o.layer_order_count = a.order.size();
    }
    sg_status_t st = sg_transfer_post(sess_, rid.c_str(), p.handle, a.table.data(), a.table.size(), a.sp.tokens, &o,
                                      &a.x, &err);
    if (st != SG_OK) return fail(st, "sg_transfer_post");
    if (a.sp.cancel == Cancel::PrefillBefore) {
        sg_transfer_cancel(a.x);
        notify("GO " + std::to_string(a.n));
        return;
    }
    for (uint32_t i = 0; i < layers; ++i) {
        const uint32_t l = a.order[i];
        if (!a.sp.all_written) {
            fill_layer(p, a.sp, a.table, l);
            st = sg_transfer_layer_written(a.x, l, nullptr);
            if (st != SG_OK && !(st == SG_ERR_CANCELED && a.sp.cancel == Cancel::DecodeBefore))
                return fail(st, "sg_transfer_layer_written");
        }
        if (a.sp.cancel == Cancel::PrefillAfter) {
            // After the match: the first layer has been delivered, so the decode side expected it.
            st = sg_transfer_wait_layer_state(a.x, l, SG_LAYER_READY, uint64_t(cfg_.wait_s) * kSecond);
            if (st == SG_ERR_TIMEOUT) return fail(SG_ERR_TIMEOUT, "waiting for the first layer before a cancel");
            if (st != SG_OK) return fail(st, "sg_transfer_wait_layer_state");
            sg_transfer_cancel(a.x);
            return;
        }
    }
}

// ---- finish: wait, fetch, verify, release ------------------------------------------------------------
sg_status_t SideRunner::fetch_and_check(Active &a, uint32_t layer, const std::vector<uint32_t> &blocks,
                                        std::string &detail) {
    const uint64_t wait = uint64_t(cfg_.wait_s) * kSecond;
    const uint64_t deadline = now_ns() + wait;
    sg_status_t st;
    // A fetch before the prefill side matched the request is refused (docs/paths.md); poll for the match.
    while ((st = sg_transfer_fetch(a.x, layer, blocks.data(), blocks.size())) == SG_ERR_INVALID_STATE) {
        if (now_ns() > deadline) {
            detail = "sg_transfer_fetch stayed SG_ERR_INVALID_STATE (no match) for the whole wait";
            return SG_OK;
        }
        sleep_ms(1);
    }
    if (st != SG_OK) return st;
    st = sg_transfer_wait_blocks(a.x, layer, blocks.data(), blocks.size(), wait);
    if (st == SG_ERR_TIMEOUT) {
        detail = "hang: sg_transfer_wait_blocks timed out";
        return SG_OK;
    }
    if (st != SG_OK) return st;
    std::string bad;
    verify_blocks(pools_[a.sp.kind], a.sp, a.table, layer, blocks, &bad);
    if (!bad.empty()) detail = "after fetch: " + bad;
    return SG_OK;
}

sg_status_t SideRunner::check_resident(Active &a, uint64_t *bytes, std::string &detail) {
    Pool &p = pools_[a.sp.kind];
    std::vector<uint8_t> bm((a.table.size() + 7) / 8);
    for (uint32_t l = 0; l < p.layout.num_layers; ++l) {
        size_t bits = 0;
        sg_status_t st = sg_transfer_residency(a.x, l, bm.data(), bm.size(), &bits);
        if (st != SG_OK) return st;
        std::vector<uint32_t> res;
        for (uint32_t i = 0; i < bits; ++i)
            if (bm[i / 8] & (1u << (i % 8))) res.push_back(i);
        if (res.empty()) continue;
        std::string bad;
        uint64_t b = verify_blocks(p, a.sp, a.table, l, res, &bad);
        if (bytes) *bytes += b;
        if (!bad.empty()) {
            detail = "resident block: " + bad;
            return SG_OK;
        }
    }
    return SG_OK;
}

sg_status_t SideRunner::finish_decode(Active &a, uint64_t &bytes, std::string &detail) {
    Pool &p = pools_[a.sp.kind];
    const uint32_t layers = p.layout.num_layers;
    const uint64_t wait = uint64_t(cfg_.wait_s) * kSecond;
    Rng r(mix(cfg_.seed, skey_, a.n, 4));
    auto verify_all = [&]() {
        for (uint32_t l = 0; l < layers && detail.empty(); ++l) bytes += verify_blocks(p, a.sp, a.table, l, {}, &detail);
    };
    auto waited = [&](sg_status_t st) {
        if (st == SG_ERR_TIMEOUT) detail = "hang: sg_transfer_wait timed out";
        return st == SG_ERR_TIMEOUT ? SG_OK : st;
    };
    sg_status_t st;
    if (a.sp.cancel != Cancel::None) {
        if (a.sp.cancel == Cancel::DecodeAfter) {
            st = sg_transfer_wait_layer(a.x, uint32_t(r.below(layers)), wait);
            if (st == SG_ERR_TIMEOUT) {
                detail = "hang: sg_transfer_wait_layer before a cancel timed out";
                return SG_OK;
            }
            if (st != SG_OK) return st;
            sg_transfer_cancel(a.x);
        }
        st = waited(sg_transfer_wait(a.x, wait));
        if (st == SG_OK && detail.empty()) verify_all();
        return st;
    }
    const bool proactive = a.sp.paths & SG_PATH_PROACTIVE, on_demand = a.sp.paths & SG_PATH_ON_DEMAND;
    const bool completes = a.sp.paths & (SG_PATH_FULL | SG_PATH_SPECULATIVE);
    if (proactive) {
        const size_t want = a.table.size() * p.layout.num_kv_heads * 2 * p.layout.head_dim;
        for (uint32_t l = 0; l < layers; ++l) {
            st = sg_transfer_wait_layer_state(a.x, l, SG_LAYER_ESSENTIAL, wait);
            if (st == SG_ERR_TIMEOUT) {
                detail = "hang: waiting for SG_LAYER_ESSENTIAL timed out";
                return SG_OK;
            }
            if (st != SG_OK) return st;
            size_t count = 0;
            st = sg_transfer_digests(a.x, l, nullptr, 0, &count);
            if (st != SG_OK) return st;
            if (count != want) {
                detail = "digests of layer " + std::to_string(l) + ": " + std::to_string(count) + " floats, want " +
                         std::to_string(want);
                return SG_OK;
            }
        }
        st = check_resident(a, nullptr, detail);
        if (st != SG_OK || !detail.empty()) return st;
    }
    if (on_demand && !(a.sp.fetch_all && !completes)) {
        for (int k = 0; k < a.sp.fetch_rounds; ++k) {
            uint32_t l = uint32_t(r.below(layers));
            std::vector<uint32_t> blocks;
            for (uint32_t i = 0; i < a.table.size(); ++i)
                if (r.unit() < 0.3) blocks.push_back(i);
            if (blocks.empty()) blocks.push_back(uint32_t(r.below(a.table.size())));
            st = fetch_and_check(a, l, blocks, detail);
            if (st != SG_OK || !detail.empty()) return st;
        }
    }
    if (on_demand && a.sp.fetch_all && !completes) {
        std::vector<uint32_t> all(a.table.size());
        for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
        for (uint32_t l = 0; l < layers; ++l) {
            st = fetch_and_check(a, l, all, detail);
            if (st != SG_OK || !detail.empty()) return st;
        }
        st = waited(sg_transfer_wait(a.x, wait));  // every block fetched: the transfer completes
        if (st == SG_OK && detail.empty()) verify_all();
        return st;
    }
    if (completes) {
        st = waited(sg_transfer_wait(a.x, wait));
        if (st == SG_OK && detail.empty()) verify_all();
        return st;
    }
    // Selective without the speculative path: verify what is resident, then end it early by release.
    st = sg_transfer_test(a.x);
    if (st != SG_OK && st != SG_IN_PROGRESS) return st;
    return check_resident(a, &bytes, detail);
}

void SideRunner::finish(Active &a) {
    uint64_t bytes = 0;
    std::string detail;
    sg_status_t st = a.start_status;
    if (!a.x) {  // the post/expect (or the wait for the peer's cancel before it) failed
        bool expected = (st == SG_ERR_PEER_LOST && loss_expected_) ||
                        (st == SG_ERR_CANCELED && a.sp.cancel != Cancel::None);
        report(a, st, 0, expected ? "" : a.start_detail);
        return;
    }
    if (st != SG_OK) {
        // The post/expect worked but a later step of start failed: the transfer's own status decides.
        if (st == SG_ERR_TIMEOUT) detail = "hang: " + a.start_detail;
        sg_status_t ts = SG_OK;
        sg_transfer_status(a.x, &ts, nullptr, 0);
        if (ts == SG_ERR_PEER_LOST || st == SG_ERR_PEER_LOST)
            st = SG_ERR_PEER_LOST;
        else if (detail.empty())
            detail = a.start_detail + " (transfer: " + xfer_detail(a.x, ts) + ")";
    } else if (prefill_) {
        st = sg_transfer_wait(a.x, uint64_t(cfg_.wait_s) * kSecond);
        if (st == SG_ERR_TIMEOUT) {
            detail = "hang: sg_transfer_wait timed out (prefill)";
            st = SG_OK;  // the detail says why it is bad
        }
    } else {
        st = finish_decode(a, bytes, detail);
    }
    if (st != SG_OK && st != SG_ERR_PEER_LOST && !(st == SG_ERR_CANCELED && a.sp.cancel != Cancel::None) &&
        detail.empty())
        detail = xfer_detail(a.x, st);
    if (st == SG_ERR_PEER_LOST && !loss_expected_ && detail.empty()) detail = xfer_detail(a.x, st);
    sg_status_t rs = sg_transfer_release(a.x);
    if (rs != SG_OK && detail.empty()) detail = std::string("sg_transfer_release: ") + sg_status_str(rs);
    report(a, st, bytes, detail);
}

SideRunner::End SideRunner::run(sg_session_t sess, uint64_t &next_n, uint64_t target) {
    sess_ = sess;
    std::deque<Active> inflight;
    for (;;) {
        if (!lost_ && !broken_ && next_n < target && inflight.size() < size_t(cfg_.window)) {
            inflight.emplace_back();
            inflight.back().n = next_n++;
            start(inflight.back());
            if (inflight.back().start_status == SG_ERR_PEER_LOST) lost_ = true;
            continue;
        }
        if (inflight.empty()) break;
        finish(inflight.front());
        inflight.pop_front();
    }
    if (lost_) return End::Lost;
    if (broken_) return End::Broken;
    return End::Done;
}

}  // namespace soak
