#include "plan/transfer_state.hpp"

namespace sg::plan {

bool legal_transition(TransferState from, TransferState to) {
    using S = TransferState;
    switch (from) {
        case S::Unmatched: return to == S::Running || to == S::Finished;
        case S::Running: return to == S::Finished;
        case S::Finished: return to == S::Quiesced || to == S::Released;
        case S::Quiesced: return to == S::Released;
        case S::Released: return false;
    }
    return false;
}

const char *state_name(TransferState s) {
    switch (s) {
        case TransferState::Unmatched: return "Unmatched";
        case TransferState::Running: return "Running";
        case TransferState::Finished: return "Finished";
        case TransferState::Quiesced: return "Quiesced";
        case TransferState::Released: return "Released";
    }
    return "?";
}

}  // namespace sg::plan
