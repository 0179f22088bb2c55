package smartgen

import (
	"fmt"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// Status is a SmartGen status code (sg_status_t). Values are pinned by the C header; a newer
// library may return a code this package does not name, which keeps its number and is classified
// by its range (see Class).
//
// Status implements error, so errors.Is(err, smartgen.StatusTimeout) tests an error returned by
// this package for a status.
type Status int32

// The statuses of include/smartgen/smartgen.h.
const (
	StatusOK         Status = 0
	StatusInProgress Status = 1

	StatusInvalidArgument Status = -1
	StatusInvalidHandle   Status = -2
	StatusInvalidLayout   Status = -3
	StatusLayoutMismatch  Status = -4
	StatusOutOfRange      Status = -5
	StatusBufferTooSmall  Status = -6
	StatusInvalidState    Status = -7
	StatusDuplicate       Status = -8
	StatusVersionMismatch Status = -9
	StatusNotFound        Status = -10

	StatusNoMemory Status = -100
	StatusAgain    Status = -101
	StatusTimeout  Status = -102
	StatusCanceled Status = -103

	StatusTransport    Status = -200
	StatusPeerLost     Status = -201
	StatusProtocol     Status = -202
	StatusDeadline     Status = -203
	StatusConnect      Status = -204
	StatusRemote       Status = -205
	StatusAuthFailed   Status = -206
	StatusAuthRequired Status = -207
	StatusLeaseExpired Status = -208

	StatusUnsupported Status = -300
	StatusNoProvider  Status = -301
	StatusInternal    Status = -399
)

// String is the library's name of the status ("SG_ERR_TIMEOUT"); an unknown code reads
// "SG_STATUS_UNKNOWN(-142)".
func (s Status) String() string {
	name := raw.Sg_status_str(int32(s))
	if name == "SG_STATUS_UNKNOWN" {
		return fmt.Sprintf("%s(%d)", name, int32(s))
	}
	return name
}

// Error makes a Status usable as an error value and as an errors.Is target.
func (s Status) Error() string { return s.String() }

// Class says what a caller can do about a status: the ranges of the header, which also classify
// codes a newer library adds.
type Class int

const (
	ClassOK          Class = iota // StatusOK, StatusInProgress
	ClassCaller                   // -1..-99: fix the call
	ClassResource                 // -100..-199: retry later or with less
	ClassPeer                     // -200..-299: the peer, the network or a deadline
	ClassUnsupported              // -300..-398: not supported here
	ClassInternal                 // anything else
)

// Class of the status, by its range.
func (s Status) Class() Class {
	switch {
	case s >= 0:
		return ClassOK
	case s >= -99:
		return ClassCaller
	case s >= -199:
		return ClassResource
	case s >= -299:
		return ClassPeer
	case s >= -398:
		return ClassUnsupported
	}
	return ClassInternal
}
