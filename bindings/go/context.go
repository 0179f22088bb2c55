package smartgen

import (
	"log"
	"runtime"
	"runtime/cgo"
	"sync"
	"time"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// LogLevel of the library's log (sg_log_level_t); the zero value is the library's default (warn).
type LogLevel uint32

const (
	LogDefault LogLevel = 0
	LogOff     LogLevel = 1
	LogError   LogLevel = 2
	LogWarn    LogLevel = 3
	LogInfo    LogLevel = 4
	LogDebug   LogLevel = 5
)

// ProgressSpinNone in ContextOptions.ProgressSpinUs makes the progress thread block at once.
const ProgressSpinNone = 0xFFFFFFFF

// ContextOptions mirror sg_context_options_t. The zero value of every field is the library's
// default, so ContextOptions{} is a valid configuration (it needs SG_AUTH_KEY_FILE, as the library
// reads the key from there when AuthKey is nil).
type ContextOptions struct {
	Provider  string // "" = auto; "tcp" = "tcp;ofi_rxm"; "shm"
	LocalAddr string // "" = 127.0.0.1; an address literal, or several separated by commas (rails)

	ManualProgress bool   // true: no progress thread; call Context.Progress
	ProgressSpinUs uint32 // 0 = 50 µs; ProgressSpinNone blocks at once
	MaxOpsInFlight uint32 // 0 = 64

	LogLevel LogLevel // the log goes to stderr

	PeerTimeout             time.Duration // 0 = 2 s; whole milliseconds
	MaxBytesInFlight        uint64        // 0 = 64 MiB
	MaxSessionBytesInFlight uint64        // 0 = 32 MiB
	MaxTransfersPerSession  uint32        // 0 = 1024
	Lanes                   uint32        // 0 = the library's choice

	AuthKey              []byte // 32..4096 bytes, copied; nil = the file named by SG_AUTH_KEY_FILE
	AllowUnauthenticated bool   // run without a key (trusted networks only)

	// EventBuffer > 0 installs the transfer event callback and delivers events on
	// Context.Events, a channel of that capacity. See Event for what happens when it is full.
	EventBuffer int
	// EventWait is how long the progress thread may wait for room in a full event channel
	// before it drops the event (counted by Context.DroppedEvents). 0 drops at once.
	EventWait time.Duration
}

// Context is one engine process's SmartGen runtime (sg_context_t): fabric, progress thread,
// registries. All its methods, and those of the objects made from it, are safe for concurrent
// use. Close destroys it and, with it, every object made from it that is still open.
type Context struct {
	// mu is held shared by every native call on the context or its objects and exclusively by
	// Close: sg_context_destroy must not run concurrently with any of them. Waits hold it for
	// one slice at a time (see waitSlice), so Close is never kept waiting for long.
	mu     sync.RWMutex
	closed bool
	h      uintptr

	events     *eventSink
	userHandle cgo.Handle
	transfers  sync.Map // native handle -> *Transfer, for Event.Transfer
}

// NewContext creates a context (sg_context_create).
func NewContext(opts ContextOptions) (*Context, error) {
	o := raw.NewSg_context_options_t()
	defer raw.DeleteSg_context_options_t(o)
	raw.Sg_context_options_init(o)
	o.SetManual_progress(boolFlag(opts.ManualProgress))
	o.SetProgress_spin_us(opts.ProgressSpinUs)
	o.SetMax_ops_in_flight(opts.MaxOpsInFlight)
	o.SetLog_level(uint32(opts.LogLevel))
	o.SetPeer_timeout_ms(uint32(opts.PeerTimeout / time.Millisecond))
	o.SetMax_bytes_in_flight(opts.MaxBytesInFlight)
	o.SetMax_session_bytes_in_flight(opts.MaxSessionBytesInFlight)
	o.SetMax_transfers_per_session(opts.MaxTransfersPerSession)
	o.SetAllow_unauthenticated(boolFlag(opts.AllowUnauthenticated))
	o.SetLanes(opts.Lanes)

	c := &Context{}
	var eventFn, eventUser uintptr
	if opts.EventBuffer > 0 {
		c.events = &eventSink{ch: make(chan Event, opts.EventBuffer), wait: opts.EventWait, c: c}
		c.userHandle = cgo.NewHandle(c.events)
		eventFn = uintptr(eventTrampoline())
		eventUser = uintptr(c.userHandle)
	}
	var h uintptr // out-parameters are locals: cgo checks the whole object a pointer points into
	e := getErrInfo()
	err := e.result("sg_context_create", raw.Sgo_context_create(o, opts.Provider, opts.LocalAddr,
		string(opts.AuthKey), uint64(len(opts.AuthKey)), eventFn, eventUser, &h, e.p))
	c.h = h
	if err != nil {
		if c.events != nil {
			c.userHandle.Delete()
		}
		return nil, err
	}
	// A safety net, not a way to manage contexts: one dropped without Close is destroyed when the
	// collector finds it unreachable (its threads, descriptors and memory go back), with a log line
	// saying it should have been closed (git2go's pattern). A context with an EventBuffer is kept
	// reachable by its event channel's handle until Close, so it has no such net.
	if c.events == nil {
		runtime.SetFinalizer(c, finalizeContext)
	}
	return c, nil
}

func finalizeContext(c *Context) {
	if c.isClosed() {
		return
	}
	log.Printf("smartgen: a Context was garbage-collected without Close; destroyed now (call Close)")
	_ = c.Close()
}

func boolFlag(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// enter guards one native call against Close; false when the context is closed.
func (c *Context) enter() bool {
	c.mu.RLock()
	if c.closed {
		c.mu.RUnlock()
		return false
	}
	return true
}

func (c *Context) leave() { c.mu.RUnlock() }

// call runs one native call that reports failure through an error info, guarded against Close.
func (c *Context) call(op string, fn func(e raw.Sg_error_info_t) int32) error {
	if !c.enter() {
		return closedError(op, "context")
	}
	defer c.leave()
	e := getErrInfo()
	return e.result(op, fn(e.p))
}

// Close destroys the context (sg_context_destroy): its sessions, listeners, registrations and
// transfers are closed with it (transfers canceled), and the event channel is closed once no
// more events can come. It waits for calls in progress on the context's objects (at most one
// wait slice). Safe to call more than once.
func (c *Context) Close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	e := getErrInfo()
	err := e.result("sg_context_destroy", raw.Sgo_sg_context_destroy(c.h, e.p))
	c.mu.Unlock()
	if c.events != nil {
		// sg_context_destroy has stopped the progress thread: no callback runs any more.
		close(c.events.ch)
		c.userHandle.Delete()
	}
	return err
}

// Provider the context runs on ("tcp;ofi_rxm", "shm", ...).
func (c *Context) Provider() (string, error) {
	buf := make([]byte, 256)
	err := c.call("sg_context_provider", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_context_provider(c.h, &buf[0], uint64(len(buf)), e)
	})
	return cString(buf), err
}

// Progress drives progress once; needed only with ContextOptions.ManualProgress.
func (c *Context) Progress() error {
	return c.call("sg_context_progress", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_context_progress(c.h, e)
	})
}

// Events is the channel of transfer events; nil unless ContextOptions.EventBuffer > 0. It is
// closed by Close.
func (c *Context) Events() <-chan Event {
	if c.events == nil {
		return nil
	}
	return c.events.ch
}

// DroppedEvents counts the events dropped because the event channel stayed full.
func (c *Context) DroppedEvents() uint64 {
	if c.events == nil {
		return 0
	}
	return c.events.dropped.Load()
}

// cString is the text before the first NUL of a buffer a C call filled.
func cString(buf []byte) string {
	for i, b := range buf {
		if b == 0 {
			return string(buf[:i])
		}
	}
	return string(buf)
}

// firstOrNil is the address of a slice's first element for a borrowed C array, nil when empty.
func firstOrNil(s []uint32) *uint32 {
	if len(s) == 0 {
		return nil
	}
	return &s[0]
}
