package smartgen

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestBadLayoutNamesTheField(t *testing.T) {
	bad := testLayout
	bad.NumKVHeads = 0
	pool, err := NewPool(bad)
	if pool != nil {
		t.Fatal("NewPool accepted num_kv_heads 0")
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %T %v is not an *Error", err, err)
	}
	if e.Status() != StatusInvalidLayout || !errors.Is(err, StatusInvalidLayout) {
		t.Fatalf("status %v, want %v", e.Status(), StatusInvalidLayout)
	}
	if !strings.Contains(e.Message, "num_kv_heads") {
		t.Fatalf("message %q does not name num_kv_heads", e.Message)
	}
	if e.Status().Class() != ClassCaller || e.Status().String() != "SG_ERR_INVALID_LAYOUT" {
		t.Fatalf("class %v, name %q", e.Status().Class(), e.Status().String())
	}
}

func TestUnknownStatusKeepsItsNumber(t *testing.T) {
	s := Status(-142)
	if s.String() != "SG_STATUS_UNKNOWN(-142)" || s.Class() != ClassResource {
		t.Fatalf("%v, class %v", s, s.Class())
	}
}

func TestBadInputIsRefusedWithItsReason(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	_, err := p.decodeSess.Expect("dup", p.decodeKV, []uint32{3, 3}, 32, TransferOptions{})
	if !errors.Is(err, StatusInvalidArgument) {
		t.Fatalf("a block given twice: %v", err)
	}
	_, err = p.decodeSess.Expect("range", p.decodeKV, []uint32{99}, 16, TransferOptions{})
	if !errors.Is(err, StatusOutOfRange) {
		t.Fatalf("a block beyond the pool: %v", err)
	}
	_, err = p.decodeSess.Expect("paths", p.decodeKV, []uint32{1}, 16, TransferOptions{Paths: 0x100})
	if !errors.Is(err, StatusInvalidArgument) || !strings.Contains(err.Error(), "paths") {
		t.Fatalf("unknown path bits: %v", err)
	}
	if err := p.decodeSess.Notify(nil); !errors.Is(err, StatusInvalidArgument) {
		t.Fatalf("empty notification: %v", err)
	}
	if _, err := ParseProfile(`{"version":1,"num_layers":"x"}`); !errors.Is(err, StatusInvalidArgument) ||
		err.(*Error).Message == "" {
		t.Fatalf("bad profile: %v", err)
	}
	if _, err := p.decode.Listen("localhost", 0); !errors.Is(err, StatusInvalidArgument) {
		t.Fatalf("a host name for a listener: %v", err)
	}
}

func TestClosedObjectsAnswerInvalidHandleAndCloseTwice(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	x, err := p.decodeSess.Expect("closing", p.decodeKV, []uint32{1}, 16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.decodeKV.Close(); !errors.Is(err, StatusInvalidState) {
		t.Fatalf("deregistering a pool a transfer uses: %v", err)
	}
	if err := p.decodePool.Close(); !errors.Is(err, StatusInvalidState) {
		t.Fatalf("unmapping a registered pool: %v", err)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	if err := x.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := x.LayerState(0); !errors.Is(err, StatusInvalidHandle) {
		t.Fatalf("LayerState on a released transfer: %v", err)
	}
	if err := x.Wait(context.Background()); !errors.Is(err, StatusInvalidHandle) {
		t.Fatalf("Wait on a released transfer: %v", err)
	}
	if err := p.decodeKV.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.decodeKV.Close(); err != nil {
		t.Fatalf("second KV Close: %v", err)
	}

	profile, err := ParseProfile(interopProfileJSON(2))
	if err != nil {
		t.Fatal(err)
	}
	if err := profile.Close(); err != nil {
		t.Fatal(err)
	}
	if err := profile.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := profile.JSON(); !errors.Is(err, StatusInvalidHandle) {
		t.Fatalf("JSON of a closed profile: %v", err)
	}

	// Closing the context takes its objects with it: they answer StatusInvalidHandle, and their
	// own Close has nothing left to do.
	if err := p.decode.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.decode.Close(); err != nil {
		t.Fatalf("second context Close: %v", err)
	}
	if err := p.decodeSess.Notify([]byte("x")); !errors.Is(err, StatusInvalidHandle) {
		t.Fatalf("Notify after the context closed: %v", err)
	}
	if _, err := p.decode.Listen("127.0.0.1", 0); !errors.Is(err, StatusInvalidHandle) {
		t.Fatalf("Listen on a closed context: %v", err)
	}
	if err := p.decodeSess.Close(); err != nil {
		t.Fatalf("Close of a session its context took: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// The peer sees the session go.
	for p.prefillSession.Err() == nil && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	if err := p.prefillSession.Err(); !errors.Is(err, StatusPeerLost) {
		t.Fatalf("the peer's session after this side closed: %v", err)
	}
}
