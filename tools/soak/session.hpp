// One side of one session: runs the session's transfers in order, a window of them in flight, with
// the spec's paths, fetches and cancels, and classifies each outcome (session.cpp).
#pragma once

#include "soak.hpp"

#include <deque>
#include <set>

namespace soak {

// Receives one line per transfer outcome and per notable event (worker.cpp sends them to the
// orchestrator). Outcome lines: "T <session> <n> <side> <ok|canceled|lost|bad> <bytes verified>";
// a bad one is followed by "E <session> <n> <side> <detail>".
using Emit = std::function<void(const std::string &line)>;

class SideRunner {
public:
    enum class End { Done, Lost, Broken };

    SideRunner(const Config &cfg, bool prefill, std::vector<Pool> &pools, uint64_t skey, int session, Emit emit)
        : cfg_(cfg), prefill_(prefill), pools_(pools), skey_(skey), session_(session), emit_(std::move(emit)) {}

    // Exports every pool to the session and exchanges HELLO (the session key and each side's next
    // transfer number); next_n becomes the larger of the two. false when the peer is gone or wrong
    // (*why says which).
    bool hello(sg_session_t sess, uint64_t &next_n, std::string *why);
    // Runs transfers next_n.. until target, or until the session is lost (End::Lost) or failed in
    // another way (End::Broken). next_n is advanced past every transfer started.
    End run(sg_session_t sess, uint64_t &next_n, uint64_t target);

    // Before a graceful close: tells the peer this side has nothing left to do and waits until the
    // peer says the same (a side that closed first would fail the transfers its peer has yet to
    // start). SG_OK, the session's error, or SG_ERR_TIMEOUT.
    sg_status_t finish_handshake();
    // SG_OK while the session is usable, else its error (polls notifications meanwhile).
    sg_status_t health();

    uint64_t bad() const { return bad_; }
    // Without kills (warm-up) a lost peer is itself a failure, reported with its detail.
    void set_loss_expected(bool v) { loss_expected_ = v; }

private:
    struct Active {
        uint64_t n = 0;
        Spec sp{};
        std::vector<uint32_t> table;
        std::vector<uint32_t> order;
        sg_transfer_t x = nullptr;
        sg_status_t start_status = SG_OK;  // a failed post/expect/layer_written/wait_go
        std::string start_detail;
    };

    void start(Active &a);
    void finish(Active &a);
    sg_status_t finish_decode(Active &a, uint64_t &bytes, std::string &detail);
    sg_status_t fetch_and_check(Active &a, uint32_t layer, const std::vector<uint32_t> &blocks, std::string &detail);
    sg_status_t check_resident(Active &a, uint64_t *bytes, std::string &detail);
    sg_status_t wait_go(uint64_t n);
    void poll_notifications();
    void notify(const std::string &msg);
    void report(const Active &a, sg_status_t st, uint64_t bytes, const std::string &detail);
    std::string xfer_detail(sg_transfer_t x, sg_status_t st);

    const Config &cfg_;
    bool prefill_;
    std::vector<Pool> &pools_;
    uint64_t skey_;
    int session_;
    Emit emit_;
    sg_session_t sess_ = nullptr;
    std::set<uint64_t> gos_;
    std::deque<std::string> hellos_;
    bool peer_fin_ = false;
    bool lost_ = false, broken_ = false, loss_expected_ = true;
    uint64_t bad_ = 0;
};

}  // namespace soak
