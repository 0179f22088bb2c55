package io.smartgen;

/**
 * Receives a context's transfer events. It runs on the library's progress thread (inside
 * {@link Context#progress()} with manual progress), in the order the events happened per
 * transfer, and must not block: it may call the non-blocking methods (Transfer's layerState,
 * status, error, stats, residency, fetch, cancel, layerWritten; Session's notify,
 * nextNotification, error; Context's stats), while waits, close() and accept/connect answer
 * SG_ERR_INVALID_STATE there. What it throws is logged and dropped.
 */
@FunctionalInterface
public interface EventListener {
    void onEvent(Event event);
}
