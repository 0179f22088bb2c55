package io.smartgen;

import io.smartgen.internal.EventDispatcher;

/** Turns the trampoline's arguments into an {@link Event} for the user's listener. */
final class ListenerDispatcher extends EventDispatcher {
    private final EventListener listener;

    ListenerDispatcher(EventListener listener) {
        this.listener = listener;
    }

    @Override
    protected void deliver(int kind, int layer, int status, long transfer, String requestId, int[] blocks) {
        Transfer view = transfer == 0 ? null : Transfer.borrowed(transfer, requestId);
        listener.onEvent(new Event(kind, layer, Status.of(status), view, requestId, blocks));
    }
}
