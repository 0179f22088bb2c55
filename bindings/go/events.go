package smartgen

/*
#cgo pkg-config: smartgen
#include <stdint.h>
#include <smartgen/smartgen.h>

void smartgen_go_event_trampoline(void *user, const sg_event_t *event);
*/
import "C"

import (
	"runtime/cgo"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"
)

// EventKind says what happened to a transfer (sg_event_kind_t). A newer library may add kinds;
// a receiver ignores the kinds it does not know.
type EventKind uint32

const (
	EventLayerReady     EventKind = 1 // a layer is complete on this side
	EventFinished       EventKind = 2 // the transfer finished; Status says how
	EventQuiesced       EventKind = 3 // the transfer is quiesced: its blocks may be reused
	EventEssentialReady EventKind = 4 // a layer's proactive blocks and digests are in place / delivered
	EventBlocksReady    EventKind = 5 // an on-demand fetch completed; Blocks names what it asked for
	EventLeaseExpired   EventKind = 6 // prefill: the request's lease ended
)

func (k EventKind) String() string {
	switch k {
	case EventLayerReady:
		return "layer-ready"
	case EventFinished:
		return "finished"
	case EventQuiesced:
		return "quiesced"
	case EventEssentialReady:
		return "essential-ready"
	case EventBlocksReady:
		return "blocks-ready"
	case EventLeaseExpired:
		return "lease-expired"
	}
	return "event(" + strconv.FormatUint(uint64(k), 10) + ")"
}

// Event is a copy of one sg_event_t, made on the progress thread. Events are delivered on
// Context.Events in the order they happened per transfer. The progress thread never blocks on
// the channel for longer than ContextOptions.EventWait: when the channel is still full after
// that (0: at once), the event is dropped and counted by Context.DroppedEvents, and the
// transfers go on. Events are notices; the state they announce stays readable with
// Transfer.LayerState, Transfer.Status and the waits, so a consumer that falls behind loses
// notices, never state.
type Event struct {
	Kind      EventKind
	Layer     uint32 // for the per-layer kinds; 0 otherwise
	Status    Status // StatusOK, or how the transfer (finished, quiesced) or the fetch ended
	RequestID string
	Blocks    []uint32 // EventBlocksReady: the logical blocks of the fetch

	c      *Context
	handle uintptr
}

// Transfer is the open *Transfer the event is about, or nil when it has been released (or was
// made by another context). Its methods may be called from the goroutine that receives events.
func (e Event) Transfer() *Transfer {
	if e.c == nil {
		return nil
	}
	t, ok := e.c.transfers.Load(e.handle)
	if !ok {
		return nil
	}
	return t.(*Transfer)
}

type eventSink struct {
	ch      chan Event
	wait    time.Duration
	dropped atomic.Uint64
	c       *Context
}

func (s *eventSink) deliver(ev Event) {
	select {
	case s.ch <- ev:
		return
	default:
	}
	if s.wait > 0 {
		timer := time.NewTimer(s.wait)
		defer timer.Stop()
		select {
		case s.ch <- ev:
			return
		case <-timer.C:
		}
	}
	s.dropped.Add(1)
}

func eventTrampoline() unsafe.Pointer { return unsafe.Pointer(C.smartgen_go_event_trampoline) }

// eventBlocksEnd is the size an sg_event_t must have for its blocks fields to be there (the
// library fills struct_size with its own size; fields are only appended).
var eventBlocksEnd = unsafe.Offsetof(C.sg_event_t{}.num_blocks) + unsafe.Sizeof(C.size_t(0))

//export smartgenGoEvent
func smartgenGoEvent(user C.uintptr_t, ev *C.sg_event_t) {
	sink := cgo.Handle(user).Value().(*eventSink)
	e := Event{
		Kind:   EventKind(ev.kind),
		Layer:  uint32(ev.layer),
		Status: Status(ev.status),
		c:      sink.c,
		handle: uintptr(unsafe.Pointer(ev.transfer)),
	}
	if ev.request_id != nil {
		e.RequestID = C.GoString(ev.request_id)
	}
	if uintptr(ev.struct_size) >= eventBlocksEnd && ev.blocks != nil && ev.num_blocks > 0 {
		blocks := unsafe.Slice((*uint32)(unsafe.Pointer(ev.blocks)), int(ev.num_blocks))
		e.Blocks = append([]uint32(nil), blocks...)
	}
	sink.deliver(e)
}
