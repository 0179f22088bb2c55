// runtime/plan: the life of a transfer, on either side, as one explicit state machine. The core
// drives it (it owns the sessions the transfers run on); the legal transitions live here, in one
// table, so that every change of state is checked against it. docs/protocol.md draws the diagram
// and names the message or call behind each transition.
#pragma once

#include <cstdint>

namespace sg::plan {

enum class TransferState : uint8_t {
    // Prefill: posted, the decode side's Expect not here yet. Decode: expected, the prefill side
    // has not started it (nothing heard about it yet).
    Unmatched,
    // Matched: data may move.
    Running,
    // The status is final (SG_OK or an error); operations of it may still be in flight.
    Finished,
    // Finished, and nothing of it can touch memory any more: prefill, no operation in flight;
    // decode, the peer confirmed that no write will come, or the session is closed. Its blocks may
    // be reused.
    Quiesced,
    // The host let go of it. Reached from Finished only when its operations outlived the release
    // wait (it lingers until the context goes).
    Released,
};

// Whether `from -> to` is a transition of the machine (a state never moves to itself).
bool legal_transition(TransferState from, TransferState to);
const char *state_name(TransferState s);

}  // namespace sg::plan
