// Posted operations: the cookie each carries through the provider, and what its completion does
// (budgets returned, the transfer's counts, notices that waited for it, a broken connection seen
// as a lost peer). Operations a provider will never complete (a dead local_only peer) are settled
// here too.
#include "core/core.hpp"

#include <algorithm>
#include <cerrno>

namespace sg::core {

OpCookie *Context::take_cookie() {
    if (!free_cookies_.empty()) {
        OpCookie *c = free_cookies_.back();
        free_cookies_.pop_back();
        c->in_use = true;
        c->abandoned = false;
        return c;
    }
    cookie_store_.push_back(std::make_unique<OpCookie>());
    cookie_store_.back()->in_use = true;
    return cookie_store_.back().get();
}

void Context::give_cookie(OpCookie *c) {
    c->in_use = false;
    c->abandoned = false;
    c->xfer = nullptr;
    c->session = nullptr;
    c->unit = nullptr;
    c->len = 0;
    c->bytes.clear();
    free_cookies_.push_back(c);
}

void Context::on_complete(void *cookie, int status, const char *error_text) {
    if (!cookie) {
        log.log(SG_LOG_WARN, std::string("a control message could not be received: ") + (error_text ? error_text : "?"));
        return;
    }
    auto *c = static_cast<OpCookie *>(cookie);
    if (!c->abandoned) settle(c, status, error_text);
    give_cookie(c);
}

// Operations still in the provider when a session closes (a send to a peer whose connection is
// being replaced can stay there past close's deadline) may complete after the session object is
// gone. Those of a transfer keep the session alive through the transfer; the others stop naming it,
// so their completion only returns the cookie (found by the handler fuzzer: a use-after-free).
void Session::forget_in_ops() {
    for (auto &owned : ctx->cookie_store_) {
        OpCookie *c = owned.get();
        if (!c->in_use || c->session != this || c->xfer) continue;
        if (c->kind != OpCookie::Kind::Send) {
            // A write without a transfer does not exist; settle it now so the budgets come back.
            ctx->settle(c, -ECANCELED, "the session closed");
            c->abandoned = true;
        }
        c->session = nullptr;
    }
}

void Session::abandon_ops() {
    for (auto &owned : ctx->cookie_store_) {
        OpCookie *c = owned.get();
        if (!c->in_use || c->abandoned || c->session != this) continue;
        if (c->kind == OpCookie::Kind::Send &&
            (std::find(outbox.begin(), outbox.end(), c) != outbox.end() ||
             std::find(bulk_outbox.begin(), bulk_outbox.end(), c) != bulk_outbox.end() ||
             std::find(auth_outbox.begin(), auth_outbox.end(), c) != auth_outbox.end()))
            continue;  // never posted: the outbox owns it
        ctx->settle(c, -ECANCELED, "the peer is gone and the provider will not complete this operation");
        c->abandoned = true;
    }
}

void Context::settle(OpCookie *c, int status, const char *error_text) {
    Transfer *t = c->xfer;
    if (log.enabled(SG_LOG_DEBUG))
        log.log(SG_LOG_DEBUG, "completion kind " + std::to_string(int(c->kind)) + " status " + std::to_string(status));
    if (c->kind != OpCookie::Kind::Send) {
        budget_.completed(c->len);
        if (c->session) c->session->bytes_inflight -= c->len;
        if (c->unit && c->session) c->session->uncount_inflight(*c->unit, c->len);
    }
    const bool connection_broke = is_connection_error(status);
    if (connection_broke && c->session && !c->session->closed())
        c->session->lose(SG_ERR_PEER_LOST,
                     std::string("connection to the peer broke: ") + (error_text ? error_text : ""));
    if (t) {
        SG_ASSERT(t->inflight > 0, "transfer '" + t->request_id + "': a completion with nothing in flight");
        t->inflight--;
        if (status) {
            // Once the transfer has failed (its session lost, say), the rest of its operations
            // failing too says nothing new: logged once, not once per operation.
            if (!t->finished()) {
                const std::string what = c->kind == OpCookie::Kind::Send ? "control message" : "RMA write";
                // On a session already lost, the operation failed because the peer is gone: the
                // transfer ends with the session's status, as documented, not SG_ERR_TRANSPORT.
                const bool lost = c->session && c->session->closed() && c->session->error;
                if (!lost)
                    log.log(SG_LOG_ERROR, "transfer '" + t->request_id + "': " + what + " failed: " + (error_text ? error_text : ""));
                t->fail_with(lost ? c->session->error : SG_ERR_TRANSPORT,
                              lost ? c->session->error_message : what + " failed: " + (error_text ? error_text : ""), false);
            }
        } else if (c->kind == OpCookie::Kind::Send) {
            // Completions may come in any order (a rendezvous-sized notice can finish after the
            // done notice), so whichever is last completes the transfer.
            if (t->post_side && t->prefill().done_sent()) t->complete_if_done();
        } else {
            if (c->kind == OpCookie::Kind::StagedWrite && !c->session->tp->caps().send_after_write) {
                // Without send-after-write ordering the chunk notice waits for the write's completion.
                c->session->send(std::vector<uint8_t>(c->bytes.begin(), c->bytes.end()), t);
            }
            if (c->unit) {
                SG_ASSERT(c->unit->outstanding > 0, "transfer '" + t->request_id + "': a unit's write completed twice");
                c->unit->outstanding--;
                t->selective_notices();
            } else {
                SG_ASSERT(t->layers[c->layer].out.outstanding > 0,
                          "transfer '" + t->request_id + "': layer " + std::to_string(c->layer) + "'s write completed twice");
                t->layers[c->layer].out.outstanding--;
                t->maybe_send_notices();
            }
        }
        if (t->finished()) {
            t->maybe_send_quiesced();
            t->note_quiesced();
        }
    } else if (status && !connection_broke) {
        log.log(SG_LOG_WARN, std::string("control message failed: ") + (error_text ? error_text : ""));
    }
    if (c->session && c->session->closed() && !c->session->regs_dropped) c->session->drop_registrations();
    if (c->kind == OpCookie::Kind::StagedWrite && c->session) c->session->free_send_slots |= 1u << c->staging_slot;
}

}  // namespace sg::core
