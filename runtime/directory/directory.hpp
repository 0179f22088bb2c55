// runtime/directory: engines find each other by name through an etcd v3 cluster.
//
// Depends on common/ only (and libcurl): it stores and finds opaque blobs, knows nothing of
// contexts or sessions (abi/ joins the two). etcd is reached through its HTTP/JSON gateway (the
// /v3/... paths every etcd 3.4+ member serves on its client port): libcurl is in every
// distribution, while a gRPC client would pull grpc++ and protobuf into the library that every
// serving stack links, for four calls whose payloads are a few hundred bytes.
//
// Keys under a prefix P (default "/smartgen/"):
//   P engines/<name>            a published engine's metadata blob, under the client's lease
//   P inbox/<name>/<from>       a session request for <name>: the requester's blob, under its lease
// A Client holds one lease, granted when first needed and kept alive by its own thread every third of
// the TTL; everything it wrote goes with it (destroy revokes it; a killed process's lease ends
// when the TTL passes). A lease that ended while the cluster was unreachable is granted again and
// the names re-published once a member answers.
// A name is held by the lease it was written under. Publishing a name another handle holds replaces
// that entry only when the caller's check of the held blob allows it (abi/: it verifies under the
// context's key, so a restarted engine takes its name back at once and another key's engine is
// refused); every replace and delete is conditional on the revision read, so a race cannot lose a
// name. The keep-alive thread also reads each published name back: one found gone is written again,
// one found held elsewhere is counted and written again once it is free.
#pragma once

#include "common/common.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <set>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace sg::directory {

struct Options {
    std::vector<std::string> endpoints;  // "http://host:port" of the cluster's members
    std::string prefix = "/smartgen/";
    uint32_t lease_ttl_ms = defaults::kLeaseTtlMs;
    uint32_t request_timeout_ms = defaults::kRequestTimeoutMs;  // one HTTP request to one member
};

// Parses "http://a:2379,http://b:2379" (spaces around commas allowed; "host:port" gets http://).
// Throws SG_ERR_INVALID_ARGUMENT naming the bad entry.
std::vector<std::string> parse_endpoints(const std::string &list);

// Names: 1..200 bytes of [A-Za-z0-9._-] and '/', not starting or ending with '/', no "//".
// Throws SG_ERR_INVALID_ARGUMENT saying what is wrong.
void check_name(const std::string &name);

// What a wait for session requests returns: the requester's key suffix and blob.
struct InboxEntry {
    std::string from;
    std::vector<uint8_t> blob;
};

struct Stats {
    uint64_t requests = 0;          // HTTP requests made
    uint64_t failovers = 0;         // requests retried on another member
    uint64_t keepalives = 0;        // lease keep-alives answered
    uint64_t leases_granted = 0;    // the first one, and again after one ended
    uint64_t names_taken_over = 0;  // a published name found held under another handle's lease
    uint64_t names_restored = 0;    // a published name found gone (or free again) and written back
    uint64_t keepalive_failures = 0;  // keep-alive rounds that threw (unreachable, out of memory...)
};

// The directory's threads: one round after another until stop(), each after a pause (0: none),
// behind a barrier. Whatever a round throws (an unreachable cluster, out of memory, another
// library's exception) never leaves the thread, which would end the host process: it is counted in
// failures() and, after a back-off (0: none beyond the pause), the next round runs. stop() ends a
// pause or back-off at once, calls interrupt (to end a round blocked in the cluster) and joins; a
// round under way finishes first.
class Worker {
  public:
    using Round = std::function<void()>;
    Worker(std::chrono::milliseconds pause, std::chrono::milliseconds back_off, Round round,
           std::function<void()> interrupt = {});
    ~Worker();  // stop()
    Worker(const Worker &) = delete;
    Worker &operator=(const Worker &) = delete;

    bool start();  // the thread, once: false when it was started already or stopped
    bool running() const;
    void stop();   // idempotent
    uint64_t rounds() const { return rounds_.load(); }
    uint64_t failures() const { return failures_.load(); }

  private:
    void loop();

    const std::chrono::milliseconds pause_, back_off_;
    Round round_;
    std::function<void()> interrupt_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::mutex join_mu_;  // held by stop() through the join
    bool started_ = false, stopping_ = false;
    std::thread thread_;
    std::atomic<uint64_t> rounds_{0}, failures_{0};
};

// A lease's keep-alive thread (a Client owns one): every period, one round (renew the lease, read
// the published names back) before a deadline of round_budget from its start. The thread never
// ends the host process: whatever a round throws (an unreachable cluster, out of memory, another
// library's exception) is counted in failures() and the round is tried again next period; the
// lease lives on for its TTL meanwhile.
class KeepAlive {
  public:
    using Round = std::function<void(uint64_t deadline_ns)>;
    KeepAlive(std::chrono::milliseconds period, std::chrono::milliseconds round_budget, Round round);

    void start() { worker_.start(); }  // the thread, once; later calls (and calls after stop) do nothing
    void stop() { worker_.stop(); }    // ends the wait for the next period and joins
    uint64_t rounds() const { return worker_.rounds(); }
    uint64_t failures() const { return worker_.failures(); }

  private:
    Worker worker_;
};

// Decides whether publish may replace the entry another handle holds under the name, from its blob.
using MayReplace = std::function<bool(std::span<const uint8_t> held_blob)>;

// Thread-safe. Every call that talks to the cluster takes a deadline (CLOCK_MONOTONIC ns) and fails
// with SG_ERR_CONNECT (no member answered; the message names what each said) or SG_ERR_TIMEOUT
// (the deadline passed first); a member's error answer is SG_ERR_REMOTE with its text.
class Client {
  public:
    explicit Client(Options options);  // throws SG_ERR_INVALID_ARGUMENT; talks to nobody yet
    ~Client();                         // stops the keep-alive thread and revokes the lease
    Client(const Client &) = delete;
    Client &operator=(const Client &) = delete;

    // Asks the members for their status until one answers: the cluster is there.
    void ping(uint64_t deadline_ns);

    // Writes blob under engines/<name> with the lease (granted now if there is none) and keeps it
    // there until unpublish or the client goes. A name another handle holds is replaced only when
    // may_replace(its blob) says so; otherwise SG_ERR_AUTH_FAILED naming the holder's lease.
    void publish(const std::string &name, std::span<const uint8_t> blob, uint64_t deadline_ns,
                 const MayReplace &may_replace);
    // Deletes the name if this handle still holds it (another holder's entry is left alone).
    void unpublish(const std::string &name, uint64_t deadline_ns);
    // engines/<name>'s blob; nullopt when nobody published it.
    std::optional<std::vector<uint8_t>> lookup(const std::string &name, uint64_t deadline_ns);
    // Names published under engines/<name_prefix> (every name when empty), sorted.
    std::vector<std::string> list(const std::string &name_prefix, uint64_t deadline_ns);
    // Until engines/<name> exists (present) or does not (!present): true, or false at the deadline.
    // Watches the key from the revision it was read at, so a change in between is not missed.
    bool wait(const std::string &name, bool present, uint64_t deadline_ns);

    // A session request to `name`: inbox/<name>/<from> = blob, under the lease.
    void request(const std::string &name, const std::string &from, std::span<const uint8_t> blob, uint64_t deadline_ns);
    // The oldest session request to `name`, taken out of the inbox (deleted); nullopt at the deadline.
    std::optional<InboxEntry> take_request(const std::string &name, uint64_t deadline_ns);

    // Ends the waits in progress (wait, take_request) and every later one at once, as at their
    // deadline: for the owner that is about to destroy the client from another thread.
    void interrupt();

    Stats stats() const;
    const Options &options() const { return options_; }

  private:
    struct Response;
    Response call(const std::string &path, const std::string &body, uint64_t deadline_ns);
    bool watch_once(const std::string &key, const std::string &range_end, int64_t start_revision, bool want_put,
                    bool want_delete, uint64_t deadline_ns);
    int64_t ensure_lease(uint64_t deadline_ns);
    void put_with_lease(const std::string &key, std::span<const uint8_t> blob, uint64_t deadline_ns);
    // The holder of a key as a transaction read it.
    struct Held {
        int64_t lease = 0;
        int64_t mod_revision = 0;
        std::string value;
    };
    // Writes key = blob under the lease if the key is absent (mod_revision 0) or still at
    // mod_revision; otherwise returns who holds it now (nullopt: written).
    std::optional<Held> put_if(const std::string &key, std::span<const uint8_t> blob, int64_t mod_revision,
                               uint64_t deadline_ns);
    std::optional<Held> holder(const std::string &key, uint64_t deadline_ns);
    void check_names(uint64_t deadline_ns);
    // The keep-alive thread's round: renews the lease (forgets it when it ended, so the next call
    // grants a new one and publishes every name again) and reads the names back.
    void keepalive_round(uint64_t deadline_ns);
    bool keepalive_once(uint64_t deadline_ns);

    Options options_;
    mutable std::mutex mu_;
    int64_t lease_ = 0;                                 // 0: none
    std::map<std::string, std::vector<uint8_t>> published_;  // engines/<name> -> blob, re-put on a new lease
    std::set<std::string> taken_;                            // published keys last seen held elsewhere
    size_t preferred_ = 0;                              // the member that answered last
    std::atomic<bool> interrupted_{false};
    std::atomic<uint64_t> requests_{0}, failovers_{0}, keepalives_{0}, leases_granted_{0};
    std::atomic<uint64_t> names_taken_over_{0}, names_restored_{0};
    // Declared after everything its round reads, so it is stopped before they go (the destructor
    // also stops it first, before revoking the lease).
    KeepAlive keepalive_;
};

// A published name's inbox, answered the moment a request arrives (both sides must load each
// other's blob within the peer timeout) by a thread of its own. The thread never ends the host
// process: whatever taking or answering a request throws (an unreachable cluster, out of memory,
// another library's exception) is counted in failures() and backed off from for 500 ms.
class Inbox {
  public:
    // take: the oldest request to `name` before the deadline, or nullopt (Client::take_request);
    // interrupt: ends a take in progress at once (Client::interrupt); answer: handles one request.
    using Take = std::function<std::optional<InboxEntry>(const std::string &name, uint64_t deadline_ns)>;
    using Answer = std::function<void(const InboxEntry &)>;
    Inbox(Take take, std::function<void()> interrupt, Answer answer);

    // Starts answering requests to `name`; true. An inbox serves one name: false (and nothing
    // changes) once it serves one already, or after stop().
    bool serve(const std::string &name);
    bool serving() const;
    // Interrupts the take in progress and joins the thread; idempotent.
    void stop() { worker_.stop(); }
    uint64_t failures() const { return worker_.failures(); }

  private:
    std::string name() const;

    mutable std::mutex mu_;
    std::string name_;  // "" while it serves none
    Worker worker_;     // last: stopped (by its destructor) before the name goes
};

}  // namespace sg::directory
