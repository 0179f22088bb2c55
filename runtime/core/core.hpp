// runtime/core: the context and what it owns — sessions and their bootstrap, KV pools, transfers and
// the progress engine that runs them. Uses every other runtime folder; abi/ is its only user: it
// calls the host's verbs on a Session or a Transfer (session_host.cpp, transfer_host.cpp) and the
// Context's own, never reading sessions' or transfers' fields itself.
//
// Objects and their verbs: the Context owns what every session shares (transports, operation
// cookies, the event queue, staging copy queues, budgets, the progress thread) and drives the
// progress; what happens to one session (its handlers of the peer's frames, its outboxes, its
// staging offers, its loss) is a private method of Session, what happens to one transfer (its
// sends, notices, selection, completion, quiescing) one of Transfer. A transfer's path, whole
// cache or selective, is a table of the steps where the two differ (transfer_path.hpp), chosen
// once.
//
// Where things are: context.hpp (the Context), session.hpp (with matchbook.hpp, its requests by
// id and the cancels remembered across the match), transfer.hpp (with the transfer state machine
// of plan/transfer_state.hpp), transfer_path.hpp (the paths' tables, transfer_path.cpp); the .cpp
// files by responsibility — context (lifetime and
// parameters), progress (loop, waits, events), session (open, outbox, staging slots, timers),
// session_host (a session's verbs: wait until proven, export, notify, close), session_auth,
// protocol (message type -> handler), transfer (expect, post, match, notices, quiesce),
// transfer_host (a transfer's verbs and what the host reads of it: layer written, fetch, digests,
// waits, cancel, release), scheduler, staging (slots, chunks reserved and checked, the path
// policy), staging_copy (the staging variants: a chunk's copies per memory kind and wire coding,
// staging.hpp), completions, paths_prefill, paths_decode, metrics
// (the Prometheus text), bootstrap, selection, auth (the MACs), cuda_plugin (loading the CUDA
// plugin on the first CUDA pool).
//
// Locking (docs/protocol.md §6 has the whole picture). Lock order, outermost first:
//   Listener::mu -> Context::mu;  Context::dispatch_mu_ -> Context::mu;  Context::mu -> the logger's.
//   Context::select_mu_ and Transfer::Selective::select_mu are never held with another library
//   lock; abi/'s registry locks are leaves, never held while calling into the core.
// - Context::mu guards all of the context's state, every session and transfer, and every call into
//   its transports (opened FI_THREAD_DOMAIN). The progress thread and API threads take it for short
//   sections and never block while holding it; waits happen on the condition variable `cv` or the
//   transports' wait descriptors. Staging's copies (up to a 4 MiB slot each)
//   happen outside it: chunks are reserved and checked under it and copied by run_copies with it
//   let go (staging.cpp).
// - Context::dispatch_mu_: one event dispatcher at a time, so each transfer's events stay in
//   order; callbacks run with no lock held.
// - Context::select_mu_: the selection worker's job queue.
// - Transfer::Selective::select_mu: serializes proactive selection of one transfer's layers (held
//   only around the selector; Context::mu is taken after it is let go, to commit).
// - Listener::mu: one accept at a time advances the listener's handshakes (sockets only; takes
//   Context::mu only to open the session).
#pragma once

#include "core/context.hpp"

namespace sg::core {

// ---- bootstrap (bootstrap.cpp) ----
std::unique_ptr<Listener> listen_on(Context *ctx, const char *addr, uint16_t port);
// Accepts peers and runs their handshakes concurrently (bootstrap.cpp): Hello frames each way and,
// when the context has a key, proofs both ways (SG_ERR_AUTH_FAILED / SG_ERR_AUTH_REQUIRED
// otherwise); then opens the session and agrees with the peer that both sides did (Opened). Returns
// the first session whose bootstrap finished; a handshake still under way when timeout_ns passes
// stays with the listener for the next call, with its own deadline (timeout_ns from its arrival).
std::shared_ptr<Session> accept_session(Listener &l, Context &ctx, const sg_session_options_t &opt, uint64_t timeout_ns);
std::shared_ptr<Session> connect_session(const char *addr, uint16_t port, Context &ctx, const sg_session_options_t &opt,
                                         uint64_t timeout_ns);
// The handshake itself on a connected stream socket (fd stays the caller's), blocking until it
// succeeds, fails or timeout_ns passes. Exposed for the handshake fuzzer.
wire::Hello bootstrap_exchange(int fd, const Context &ctx, uint64_t timeout_ns, auth::Role role);
// A Hello frame (bootstrap, metadata blob) decoded and checked: SG_ERR_VERSION_MISMATCH for another
// protocol major, SG_ERR_PROTOCOL for anything malformed.
wire::Hello decode_hello_frame(std::span<const uint8_t> frame);
// Parses a peer's metadata blob and checks its signature against the context's key.
wire::Hello parse_metadata(const Context &ctx, std::span<const uint8_t> blob);
// Refuses a peer whose authentication mode does not match ours.
void check_auth_policy(const Context &ctx, const wire::Hello &peer);
std::string read_boot_id();
uint64_t read_netns_inode();
uint64_t random_u64();

}  // namespace sg::core
