package smartgen

import (
	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// KV is a Pool registered with a Context (sg_kv_handle_t). Export it to a session before
// expecting into it or posting from it.
type KV struct {
	c    *Context
	pool *Pool
	h    uintptr
	life lifecycle
}

// Register registers the pool's memory with the context (sg_kv_register). The pool must stay
// open until the KV is closed.
func (c *Context) Register(p *Pool) (*KV, error) {
	if p == nil {
		return nil, newError("sg_kv_register", StatusInvalidArgument, "pool is nil")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, closedError("sg_kv_register", "pool")
	}
	o := p.cLayout()
	defer raw.DeleteSg_kv_layout_t(o)
	var h uintptr
	err := c.call("sg_kv_register", func(e raw.Sg_error_info_t) int32 {
		return raw.Sg_kv_register(c.h, o, &h, e)
	})
	if err != nil {
		return nil, err
	}
	kv := &KV{c: c, pool: p, h: h}
	p.kvs[kv] = struct{}{}
	return kv, nil
}

// Pool registered by this KV.
func (kv *KV) Pool() *Pool { return kv.pool }

func (kv *KV) open() bool { return !kv.life.closed.Load() && !kv.c.isClosed() }

// Close deregisters the pool (sg_kv_deregister). It fails with StatusInvalidState while a
// transfer that uses it is not released; the KV then stays open. Safe to call more than once.
func (kv *KV) Close() error {
	if kv == nil {
		return nil
	}
	err := kv.life.close(kv.c, "sg_kv_deregister", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_kv_deregister(kv.h, e)
	})
	if kv.life.closed.Load() {
		kv.pool.mu.Lock()
		delete(kv.pool.kvs, kv)
		kv.pool.mu.Unlock()
	}
	return err
}
