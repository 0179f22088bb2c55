// Internal to core/ (core.hpp is the folder's header): a session's book of requests by id — the
// transfers it runs on each side, the posts and Expects still waiting for their other half, and
// the cancels one side must remember until the other has heard of them (docs/protocol.md, "Cancel
// before the match"). One owner, the session; read and changed with the context's mutex held.
// Every table a peer can fill is bounded by kMaxRemembered ids, since the peer chooses them.
#pragma once

#include <smartgen/smartgen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "wire/wire.hpp"

namespace sg::core {

class Transfer;

// A cancel remembered for a request id: what the transfer it meets later ends with.
struct RememberedCancel {
    sg_status_t status;
    std::string message;
};

class Matchbook {
  public:
    static constexpr size_t kMaxRemembered = 65536;
    using TransferPtr = std::shared_ptr<Transfer>;

    // ---- Prefill side: posts by request id ----
    // A post of the id is matched or waiting (another post of it is SG_ERR_DUPLICATE).
    bool posted(const std::string &rid) const;
    // A post waiting for its Expect.
    void add_waiting_post(const TransferPtr &t);
    TransferPtr take_waiting_post(const std::string &rid);  // null when none waits
    void add_matched_post(const TransferPtr &t);
    Transfer *matched_post(const std::string &rid) const;  // null when none
    // Unfiles t wherever it is filed as a post; another transfer of the same id stays.
    void forget_post(const Transfer &t);
    // Unfiles t only if it still waits for its Expect: a post that failed while being matched
    // stays filed as matched until it is released (its id is taken, and the decode side's
    // crossing cancel of it is about it).
    void forget_waiting_post(const Transfer &t);
    // An Expect that came before any post of its id. Throws SG_ERR_PROTOCOL when kMaxRemembered
    // other ids already wait (a real decode side has max_transfers_per_session at most).
    void hold_expect(wire::Expect &&m);
    std::optional<wire::Expect> take_held_expect(const std::string &rid);
    // The decode side withdrew that Expect (the same decode transfer id only).
    void drop_held_expect(const std::string &rid, uint64_t decode_xfer_id);
    // Our cancel of a post before its Expect came. Until the decode side acknowledges it
    // (CancelAck), any Expect of the id was sent before it heard of the cancel and is answered with
    // it, even when the id has been posted again meanwhile.
    void remember_our_cancel(const std::string &rid, RememberedCancel c);
    const RememberedCancel *our_cancel(const std::string &rid) const;
    void our_cancel_acknowledged(const std::string &rid);
    // The decode side canceled its Expect before any post matched it: the next post of the id
    // ends with that status. A new Expect of the id forgets it (a new request).
    void remember_expect_canceled(const std::string &rid, RememberedCancel c);
    std::optional<RememberedCancel> take_expect_canceled(const std::string &rid);
    void forget_expect_canceled(const std::string &rid);
    // The decode side remembers our cancel of the id: the next post of it tells it so (Reposted).
    void remember_repost_needed(const std::string &rid);
    bool take_repost_needed(const std::string &rid);

    // ---- Decode side: expects by our transfer id ----
    void add_expect(const TransferPtr &t);
    void forget_expect(uint64_t decode_xfer_id);
    Transfer *expect(uint64_t decode_xfer_id) const;  // null when none
    // A cancel from the prefill side of an id we do not expect (yet): the next expect of the id
    // ends with it. False (nothing kept) when kMaxRemembered ids are remembered already.
    bool remember_peer_cancel(const std::string &rid, RememberedCancel c);
    std::optional<RememberedCancel> take_peer_cancel(const std::string &rid);
    void forget_peer_cancel(const std::string &rid);  // the prefill side posted the id again

    // ---- Both ----
    const std::map<uint64_t, TransferPtr> &expects() const { return expects_; }
    const std::map<std::string, TransferPtr> &matched_posts() const { return posts_; }
    const std::map<std::string, TransferPtr> &waiting_posts() const { return waiting_posts_; }
    // Every transfer filed (expects, matched and waiting posts): a copy, to act on while the book
    // changes.
    std::vector<TransferPtr> transfers() const;
    size_t held_expects() const { return held_expects_.size(); }
    // The largest of the tables of cancels and reposts remembered for ids.
    size_t largest_remembered() const {
        return std::max({our_cancels_.size(), expect_canceled_.size(), repost_needed_.size(), peer_canceled_.size()});
    }

  private:
    std::map<uint64_t, TransferPtr> expects_;
    std::map<std::string, TransferPtr> posts_;
    std::map<std::string, TransferPtr> waiting_posts_;
    std::map<std::string, wire::Expect> held_expects_;
    std::map<std::string, RememberedCancel> our_cancels_;
    std::map<std::string, RememberedCancel> expect_canceled_;
    std::set<std::string> repost_needed_;
    std::map<std::string, RememberedCancel> peer_canceled_;
};

}  // namespace sg::core
