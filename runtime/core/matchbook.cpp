// A session's book of requests by id (matchbook.hpp).
#include "core/matchbook.hpp"

#include "core/transfer.hpp"

namespace sg::core {

namespace {

template <class Map>
std::optional<typename Map::mapped_type> take(Map &m, const std::string &key) {
    auto it = m.find(key);
    if (it == m.end()) return std::nullopt;
    auto v = std::move(it->second);
    m.erase(it);
    return v;
}

}  // namespace

bool Matchbook::posted(const std::string &rid) const { return waiting_posts_.count(rid) || posts_.count(rid); }

void Matchbook::add_waiting_post(const TransferPtr &t) { waiting_posts_[t->request_id] = t; }

Matchbook::TransferPtr Matchbook::take_waiting_post(const std::string &rid) {
    return take(waiting_posts_, rid).value_or(nullptr);
}

void Matchbook::add_matched_post(const TransferPtr &t) { posts_[t->request_id] = t; }

Transfer *Matchbook::matched_post(const std::string &rid) const {
    auto it = posts_.find(rid);
    return it == posts_.end() ? nullptr : it->second.get();
}

void Matchbook::forget_post(const Transfer &t) {
    for (auto *m : {&posts_, &waiting_posts_})
        if (auto it = m->find(t.request_id); it != m->end() && it->second.get() == &t) m->erase(it);
}

void Matchbook::forget_waiting_post(const Transfer &t) {
    if (auto it = waiting_posts_.find(t.request_id); it != waiting_posts_.end() && it->second.get() == &t)
        waiting_posts_.erase(it);
}

void Matchbook::hold_expect(wire::Expect &&m) {
    if (held_expects_.size() >= kMaxRemembered && !held_expects_.count(m.request_id))
        fail(SG_ERR_PROTOCOL, "more than " + std::to_string(kMaxRemembered) + " Expects wait for a post");
    std::string rid = m.request_id;
    held_expects_[rid] = std::move(m);
}

std::optional<wire::Expect> Matchbook::take_held_expect(const std::string &rid) { return take(held_expects_, rid); }

void Matchbook::drop_held_expect(const std::string &rid, uint64_t decode_xfer_id) {
    auto it = held_expects_.find(rid);
    if (it != held_expects_.end() && it->second.decode_xfer_id == decode_xfer_id) held_expects_.erase(it);
}

void Matchbook::remember_our_cancel(const std::string &rid, RememberedCancel c) {
    if (our_cancels_.size() < kMaxRemembered) our_cancels_[rid] = std::move(c);
}

const RememberedCancel *Matchbook::our_cancel(const std::string &rid) const {
    auto it = our_cancels_.find(rid);
    return it == our_cancels_.end() ? nullptr : &it->second;
}

void Matchbook::our_cancel_acknowledged(const std::string &rid) { our_cancels_.erase(rid); }

void Matchbook::remember_expect_canceled(const std::string &rid, RememberedCancel c) {
    if (expect_canceled_.size() < kMaxRemembered) expect_canceled_[rid] = std::move(c);
}

std::optional<RememberedCancel> Matchbook::take_expect_canceled(const std::string &rid) {
    return take(expect_canceled_, rid);
}

void Matchbook::forget_expect_canceled(const std::string &rid) { expect_canceled_.erase(rid); }

void Matchbook::remember_repost_needed(const std::string &rid) {
    if (repost_needed_.size() < kMaxRemembered) repost_needed_.insert(rid);
}

bool Matchbook::take_repost_needed(const std::string &rid) { return repost_needed_.erase(rid) > 0; }

void Matchbook::add_expect(const TransferPtr &t) { expects_[t->id] = t; }

void Matchbook::forget_expect(uint64_t decode_xfer_id) { expects_.erase(decode_xfer_id); }

Transfer *Matchbook::expect(uint64_t decode_xfer_id) const {
    auto it = expects_.find(decode_xfer_id);
    return it == expects_.end() ? nullptr : it->second.get();
}

bool Matchbook::remember_peer_cancel(const std::string &rid, RememberedCancel c) {
    if (peer_canceled_.size() >= kMaxRemembered) return false;
    peer_canceled_[rid] = std::move(c);
    return true;
}

std::optional<RememberedCancel> Matchbook::take_peer_cancel(const std::string &rid) {
    return take(peer_canceled_, rid);
}

void Matchbook::forget_peer_cancel(const std::string &rid) { peer_canceled_.erase(rid); }

std::vector<Matchbook::TransferPtr> Matchbook::transfers() const {
    std::vector<TransferPtr> all;
    all.reserve(expects_.size() + posts_.size() + waiting_posts_.size());
    for (auto &[k, t] : expects_) all.push_back(t);
    for (auto &[k, t] : posts_) all.push_back(t);
    for (auto &[k, t] : waiting_posts_) all.push_back(t);
    return all;
}

}  // namespace sg::core
