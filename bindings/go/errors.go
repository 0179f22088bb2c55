package smartgen

import (
	"runtime"
	"sync"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// Error is a failed SmartGen call: the operation, the status and the library's message, taken in
// the same native call as the failure (so it is the message of this call even though a goroutine
// may run on another OS thread after it).
type Error struct {
	Op      string // the C function, e.g. "sg_kv_register"
	Message string // the library's detail; may be empty
	status  Status
	cause   error // context.Canceled or context.DeadlineExceeded when a wait ended for its ctx
}

// Status of the failure.
func (e *Error) Status() Status { return e.status }

func (e *Error) Error() string {
	s := "smartgen: " + e.Op + ": " + e.status.String()
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Is matches a Status (errors.Is(err, smartgen.StatusInvalidLayout)) and, through Unwrap, the
// context error that ended a wait.
func (e *Error) Is(target error) bool {
	s, ok := target.(Status)
	return ok && s == e.status
}

// Unwrap gives the context error that ended a wait (context.DeadlineExceeded or
// context.Canceled), else nil.
func (e *Error) Unwrap() error { return e.cause }

func newError(op string, status Status, message string) *Error {
	return &Error{Op: op, status: status, Message: message}
}

func closedError(op, what string) *Error {
	return newError(op, StatusInvalidHandle, what+" is closed")
}

// errInfo is one C-allocated sg_error_info_t, reused across calls without being cleared: a call
// that fails always writes its status and message (the library for the calls that take an err,
// the sgo_ shims of go.i for the others), and a call that succeeds is not read. Pooled so that a
// call that succeeds costs no allocation and no extra cgo call; the finalizer frees the C memory
// of those the pool lets go.
type errInfo struct{ p raw.Sg_error_info_t }

var errInfos = sync.Pool{New: func() any {
	e := &errInfo{p: raw.NewSg_error_info_t()}
	raw.Sg_error_info_init(e.p)
	runtime.SetFinalizer(e, func(e *errInfo) { raw.DeleteSg_error_info_t(e.p) })
	return e
}}

func getErrInfo() *errInfo { return errInfos.Get().(*errInfo) }

// result turns a native status into nil or an *Error and returns e to the pool. Statuses >= 0
// (SG_OK, SG_IN_PROGRESS) are not errors.
func (e *errInfo) result(op string, status int32) error {
	if status >= 0 {
		errInfos.Put(e)
		return nil
	}
	msg := e.p.GetMessage()
	errInfos.Put(e)
	return newError(op, Status(status), msg)
}

// okIf maps an expected status that is not a failure for the caller to SG_OK, so that result
// does not turn it into an error.
func okIf(status int32, expected Status) int32 {
	if Status(status) == expected {
		return int32(StatusOK)
	}
	return status
}
