// When a silent peer is lost, judged so that a busy host does not lose a healthy session.
//
// The old rule, "nothing heard for peer_timeout_ms of wall time", lost live sessions on a host whose
// CPUs were shared with other work (load 8-11 on two cores): either our own progress thread was off
// the CPU for seconds, so the peer's keep-alives sat unread in the completion queue while the clock
// ran, or the peer's thread was, so its keep-alives were late. Two corrections:
//  - Silence is counted only while we were watching. Each timer pass credits the time since the
//    previous pass, at most kMaxCreditPerPassNs: a pass that comes late (our thread descheduled, a
//    host thread holding the lock) is our stall, not the peer's silence. A dead peer is still found
//    in peer_timeout_ms when the passes come on time (every 10-100 ms).
//  - The timeout adapts to the gaps this peer has shown: a peer whose keep-alives have been arriving
//    up to G apart gets max(peer_timeout, kGapFactor * G), never more than kMaxStretch times the
//    configured timeout, so a dead peer is still found in bounded time. Recent gaps count: the
//    largest is halved every kGapHalfLifeNs. On a quiet host the gaps are the keep-alive period
//    (peer_timeout / 8), far under the timeout, so detection there is unchanged.
#pragma once

#include <algorithm>
#include <cstdint>

namespace sg::core {

class PeerLiveness {
  public:
    static constexpr uint64_t kMaxCreditPerPassNs = 250000000ull;  // above the progress loop's longest nap (100 ms)
    static constexpr uint64_t kGapFactor = 3;
    static constexpr uint64_t kMaxStretch = 4;
    static constexpr uint64_t kGapHalfLifeNs = 30000000000ull;

    // The session opened (or was rebuilt) at `now`: nothing heard yet, nothing missed.
    void start(uint64_t now) {
        last_heard_ns_ = last_pass_ns_ = gap_decayed_ns_ = now;
        silence_ns_ = largest_gap_ns_ = 0;
    }

    // A frame from the peer arrived.
    void heard(uint64_t now) {
        watch(now);
        decay(now);
        largest_gap_ns_ = std::max(largest_gap_ns_, silence_ns_);
        silence_ns_ = 0;
        last_heard_ns_ = now;
    }

    // A timer pass at `now`: the time since the last pass counts as silence, up to the cap.
    void watch(uint64_t now) {
        if (now > last_pass_ns_) silence_ns_ += std::min(now - last_pass_ns_, kMaxCreditPerPassNs);
        last_pass_ns_ = std::max(last_pass_ns_, now);
    }

    // How long this peer may stay silent, given the configured peer timeout.
    uint64_t timeout_ns(uint64_t configured_ns) const {
        return std::clamp(kGapFactor * largest_gap_ns_, configured_ns, kMaxStretch * configured_ns);
    }
    bool lost(uint64_t configured_ns) const { return silence_ns_ > timeout_ns(configured_ns); }

    uint64_t silence_ns() const { return silence_ns_; }          // watched time without a frame
    uint64_t largest_gap_ns() const { return largest_gap_ns_; }  // recent, decayed
    uint64_t last_heard_ns() const { return last_heard_ns_; }    // wall clock of the last frame

  private:
    void decay(uint64_t now) {
        if (now <= gap_decayed_ns_) return;
        const uint64_t halvings = (now - gap_decayed_ns_) / kGapHalfLifeNs;
        largest_gap_ns_ = halvings >= 64 ? 0 : largest_gap_ns_ >> halvings;
        gap_decayed_ns_ += halvings * kGapHalfLifeNs;
    }

    uint64_t last_heard_ns_ = 0;
    uint64_t last_pass_ns_ = 0;
    uint64_t silence_ns_ = 0;
    uint64_t largest_gap_ns_ = 0;
    uint64_t gap_decayed_ns_ = 0;
};

}  // namespace sg::core
