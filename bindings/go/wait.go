package smartgen

import (
	"context"
	"time"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// waitSlice bounds one native wait. A Go wait runs as native waits of at most this long,
// checking its context.Context between them, so cancellation is seen within a slice, and
// Context.Close (which waits for native calls in progress) is not held up longer than that.
const waitSlice = 50 * time.Millisecond

// nativeTimeout is the next slice: waitSlice, or less when the ctx deadline comes sooner.
func nativeTimeout(ctx context.Context) uint64 {
	slice := waitSlice
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < slice {
			slice = left
		}
	}
	if slice < 0 {
		return 0
	}
	return uint64(slice)
}

// ctxError is the error of a wait that ctx ended: StatusTimeout (the object is as it was and the
// wait may be repeated) wrapping ctx.Err(), so that errors.Is(err, context.DeadlineExceeded) or
// errors.Is(err, context.Canceled) says why.
func ctxError(op string, ctx context.Context) *Error {
	cause := ctx.Err()
	return &Error{Op: op, status: StatusTimeout, Message: cause.Error(), cause: cause}
}

// wait repeats a native wait in slices until it returns something other than SG_ERR_TIMEOUT,
// ctx ends, or the object or its context is closed.
func (l *lifecycle) wait(ctx context.Context, c *Context, op, what string,
	fn func(timeoutNs uint64, e raw.Sg_error_info_t) int32) error {
	for {
		if ctx.Err() != nil {
			return ctxError(op, ctx)
		}
		if l.closed.Load() {
			return closedError(op, what)
		}
		if !c.enter() {
			return closedError(op, "context")
		}
		e := getErrInfo()
		status := fn(nativeTimeout(ctx), e.p)
		c.leave()
		err := e.result(op, status)
		if Status(status) != StatusTimeout {
			return err
		}
	}
}
