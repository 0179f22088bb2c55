package smartgen

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// lifecycle is the Close bookkeeping of an object made from a Context: Close runs its native
// destroy once, later calls fail without a native call, and an object whose context was closed
// first counts as closed (the context's destroy took it).
type lifecycle struct {
	mu     sync.Mutex // serialises Close
	closed atomic.Bool
}

func (l *lifecycle) call(c *Context, op, what string, fn func(e raw.Sg_error_info_t) int32) error {
	if l.closed.Load() {
		return closedError(op, what)
	}
	return c.call(op, fn)
}

// close runs destroy unless already done. A destroy the library refuses with
// StatusInvalidState (a registration still in use) leaves the object open, to be closed later.
func (l *lifecycle) close(c *Context, op string, destroy func(e raw.Sg_error_info_t) int32) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed.Load() {
		return nil
	}
	if !c.enter() {
		l.closed.Store(true)
		return nil
	}
	e := getErrInfo()
	err := e.result(op, destroy(e.p))
	c.leave()
	if errors.Is(err, StatusInvalidState) {
		return err
	}
	l.closed.Store(true)
	return err
}

func (c *Context) isClosed() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.closed
}
