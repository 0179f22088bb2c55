package smartgen

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A transfer nobody posts: its waits end only by their ctx.
func TestWaitEndsWithItsContext(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	x, err := p.decodeSess.Expect("never-posted", p.decodeKV, []uint32{1, 2}, 32, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()

	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(100 * time.Millisecond)
		cancel()
	}()
	start := time.Now()
	err = x.Wait(ctx)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, StatusTimeout) {
		t.Fatalf("canceled wait: %v", err)
	}
	if d := time.Since(start); d > 100*time.Millisecond+4*waitSlice {
		t.Fatalf("cancellation seen after %v", d)
	}

	dctx, dcancel := context.WithTimeout(context.Background(), 80*time.Millisecond)
	defer dcancel()
	err = x.WaitLayer(dctx, 0)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, StatusTimeout) {
		t.Fatalf("wait past its deadline: %v", err)
	}
	if err := x.WaitBlocks(dctx, 0, []uint32{0}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait with a deadline already passed: %v", err)
	}
	// The transfer is as it was.
	if state, err := x.LayerState(0); err != nil || state&StateReady != 0 {
		t.Fatalf("state %#x, %v", state, err)
	}
	if err := x.Test(); !errors.Is(err, StatusInProgress) {
		t.Fatalf("Test: %v", err)
	}
}

func TestAcceptEndsWithItsContext(t *testing.T) {
	c, err := NewContext(ContextOptions{Provider: "tcp", AuthKey: testKey(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l, err := c.Listen("127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Millisecond)
	defer cancel()
	if _, err := l.Accept(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Accept without a peer: %v", err)
	}
}

// Closing the context ends a wait in progress on one of its transfers, from another goroutine.
func TestContextCloseEndsAWaitInProgress(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	x, err := p.decodeSess.Expect("closed-under-wait", p.decodeKV, []uint32{1}, 16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- x.Wait(context.Background()) }()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	if err := p.decode.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, StatusInvalidHandle) && !errors.Is(err, StatusCanceled) {
			t.Fatalf("the wait ended with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the wait did not end when its context was closed")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Close and the wait took %v", d)
	}
	if err := x.Release(); err != nil {
		t.Fatalf("Release after the context closed: %v", err)
	}
}
