package smartgen

import (
	"context"
	"errors"
	"time"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// NotifyMax is the largest notification, in bytes (SG_NOTIFY_MAX).
const NotifyMax = 4096

// DefaultConnectTimeout bounds Connect when its ctx has no deadline.
const DefaultConnectTimeout = 60 * time.Second

// notificationPoll is how often WaitNotification looks for a notification.
const notificationPoll = time.Millisecond

// Listener accepts sessions on a bootstrap address (sg_listener_t).
type Listener struct {
	c    *Context
	h    uintptr
	port uint16
	life lifecycle
}

// Listen listens on addr:port (an address literal; port 0 picks a free port, see Port).
func (c *Context) Listen(addr string, port uint16) (*Listener, error) {
	var h uintptr
	err := c.call("sg_listener_create", func(e raw.Sg_error_info_t) int32 {
		return raw.Sg_listener_create(c.h, addr, port, &h, e)
	})
	if err != nil {
		return nil, err
	}
	l := &Listener{c: c, h: h}
	var bound uint16
	err = c.call("sg_listener_port", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_listener_port(h, &bound, e)
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	l.port = bound
	return l, nil
}

// Port the listener is bound to.
func (l *Listener) Port() uint16 { return l.port }

// Accept waits for one peer and runs the bootstrap and authentication (sg_session_accept), until
// ctx ends. A handshake under way when ctx ends goes on with the next Accept.
func (l *Listener) Accept(ctx context.Context) (*Session, error) {
	var h uintptr
	err := l.life.wait(ctx, l.c, "sg_session_accept", "listener", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_session_accept(l.h, "", timeout, &h, e)
	})
	if err != nil {
		return nil, err
	}
	return &Session{c: l.c, h: h}, nil
}

// Close closes the listener; sessions it accepted stay. Safe to call more than once.
func (l *Listener) Close() error {
	if l == nil {
		return nil
	}
	return l.life.close(l.c, "sg_listener_destroy", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_listener_destroy(l.h, e)
	})
}

// Session is a link to one peer context (sg_session_t).
type Session struct {
	c    *Context
	h    uintptr
	life lifecycle
}

// Connect connects to a listener at addr:port (sg_session_connect). The native connect runs for
// the time left until ctx's deadline, or DefaultConnectTimeout without one; when ctx is canceled
// first, Connect returns at once and a session made afterwards is destroyed.
func (c *Context) Connect(ctx context.Context, addr string, port uint16) (*Session, error) {
	if ctx.Err() != nil {
		return nil, ctxError("sg_session_connect", ctx)
	}
	timeout := DefaultConnectTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
		if timeout < 0 {
			timeout = 0
		}
	}
	type result struct {
		s   *Session
		err error
	}
	done := make(chan result, 1)
	go func() {
		var h uintptr
		err := c.call("sg_session_connect", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_session_connect(c.h, addr, port, "", uint64(timeout), &h, e)
		})
		if err != nil {
			done <- result{nil, err}
			return
		}
		done <- result{&Session{c: c, h: h}, nil}
	}()
	select {
	case r := <-done:
		if errors.Is(r.err, StatusTimeout) && ctx.Err() != nil {
			return nil, ctxError("sg_session_connect", ctx)
		}
		return r.s, r.err
	case <-ctx.Done():
		go func() {
			if r := <-done; r.s != nil {
				r.s.Close()
			}
		}()
		return nil, ctxError("sg_session_connect", ctx)
	}
}

// Export registers kv for this session and tells the peer (sg_session_export_kv).
func (s *Session) Export(kv *KV) error {
	if s == nil || kv == nil {
		return newError("sg_session_export_kv", StatusInvalidArgument, "session or kv is nil")
	}
	return s.life.call(s.c, "sg_session_export_kv", "session", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_export_kv(s.h, kv.h, e)
	})
}

// Provider the session runs on.
func (s *Session) Provider() (string, error) {
	buf := make([]byte, 256)
	err := s.life.call(s.c, "sg_session_provider", "session", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_provider(s.h, &buf[0], uint64(len(buf)), e)
	})
	return cString(buf), err
}

// Notify sends a small message (1..NotifyMax bytes) to the peer, in order with the session's
// other control messages (sg_session_notify).
func (s *Session) Notify(msg []byte) error {
	var p *byte
	if len(msg) > 0 {
		p = &msg[0]
	}
	return s.life.call(s.c, "sg_session_notify", "session", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_notify(s.h, p, uint64(len(msg)), e)
	})
}

// NextNotification takes the oldest notification that arrived; ok is false when none is waiting.
func (s *Session) NextNotification() (msg []byte, ok bool, err error) {
	for {
		// The size first (a NULL buffer keeps the message), so the copy is exactly its size.
		var n uint64
		var status int32
		err = s.life.call(s.c, "sg_session_next_notification", "session", func(e raw.Sg_error_info_t) int32 {
			status = raw.Sgo_sg_session_next_notification(s.h, nil, 0, &n, e)
			return okIf(status, StatusAgain)
		})
		if err != nil || Status(status) == StatusAgain {
			return nil, false, err
		}
		buf := make([]byte, n+1) // +1: never a zero-length buffer, which would be NULL
		err = s.life.call(s.c, "sg_session_next_notification", "session", func(e raw.Sg_error_info_t) int32 {
			status = raw.Sgo_sg_session_next_notification(s.h, &buf[0], uint64(len(buf)), &n, e)
			return okIf(okIf(status, StatusAgain), StatusBufferTooSmall)
		})
		if err != nil {
			return nil, false, err
		}
		if Status(status) == StatusOK {
			return buf[:n], true, nil
		}
		// Another goroutine took it, or a larger one came first: look again.
	}
}

// WaitNotification polls for the next notification until one arrives, the session fails, or ctx
// ends.
func (s *Session) WaitNotification(ctx context.Context) ([]byte, error) {
	for {
		msg, ok, err := s.NextNotification()
		if err != nil || ok {
			return msg, err
		}
		if err := s.Err(); err != nil {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, ctxError("sg_session_next_notification", ctx)
		case <-time.After(notificationPoll):
		}
	}
}

// Err is nil while the session is usable, else why it is not (sg_session_error), e.g.
// StatusPeerLost with the detail.
func (s *Session) Err() error {
	var health int32
	buf := make([]byte, 512)
	err := s.life.call(s.c, "sg_session_error", "session", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_error(s.h, &health, &buf[0], uint64(len(buf)), e)
	})
	if err != nil {
		return err
	}
	if health < 0 {
		return newError("sg_session_error", Status(health), cString(buf))
	}
	return nil
}

// Shutdown closes the session gracefully (sg_session_close): no new transfers, then it waits
// until every transfer on it has finished and the peer has read what this side sent. When ctx
// ends first the session is still draining: call Shutdown again, or Close to cancel what is
// left. Close is still needed afterwards to free the handle.
func (s *Session) Shutdown(ctx context.Context) error {
	return s.life.wait(ctx, s.c, "sg_session_close", "session", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_close(s.h, timeout, e)
	})
}

// Close closes the session at once (sg_session_destroy); its unfinished transfers are canceled.
// Safe to call more than once.
func (s *Session) Close() error {
	if s == nil {
		return nil
	}
	return s.life.close(s.c, "sg_session_destroy", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_destroy(s.h, e)
	})
}

// Metadata is this context's metadata blob (sg_context_get_metadata), for hosts that carry their
// own control channel: the peer passes it to SessionFromMetadata.
func (c *Context) Metadata() ([]byte, error) {
	for {
		var n uint64
		err := c.call("sg_context_get_metadata", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_sg_context_get_metadata(c.h, nil, 0, &n, e)
		})
		if err != nil {
			return nil, err
		}
		blob := make([]byte, n+1)
		err = c.call("sg_context_get_metadata", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_sg_context_get_metadata(c.h, &blob[0], uint64(len(blob)), &n, e)
		})
		if !errors.Is(err, StatusBufferTooSmall) { // the blob may grow between the two calls
			return blob[:n], err
		}
	}
}

// SessionFromMetadata makes a session from the peer's metadata blob (sg_session_from_metadata).
// Both sides load the other's blob; with a key, the session authenticates over the fabric
// afterwards (see Session.WaitReady).
func (c *Context) SessionFromMetadata(blob []byte) (*Session, error) {
	var p *byte
	if len(blob) > 0 {
		p = &blob[0]
	}
	var h uintptr
	err := c.call("sg_session_from_metadata", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_session_from_metadata(c.h, p, uint64(len(blob)), "", &h, e)
	})
	if err != nil {
		return nil, err
	}
	return &Session{c: c, h: h}, nil
}

// WaitReady waits until the session is authenticated and usable (sg_session_wait_ready); sessions
// from Accept and Connect are ready at once.
func (s *Session) WaitReady(ctx context.Context) error {
	return s.life.wait(ctx, s.c, "sg_session_wait_ready", "session", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_session_wait_ready(s.h, timeout, e)
	})
}
