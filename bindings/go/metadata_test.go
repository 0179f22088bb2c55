package smartgen

import (
	"context"
	"testing"
	"time"
)

// Two contexts that exchange metadata blobs instead of a bootstrap socket, then move a request.
func TestSessionFromMetadata(t *testing.T) {
	key := testKey(t)
	a, err := NewContext(ContextOptions{Provider: "tcp", AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewContext(ContextOptions{Provider: "tcp", AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	blobA, err := a.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	blobB, err := b.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	sa, err := a.SessionFromMetadata(blobB)
	if err != nil {
		t.Fatal(err)
	}
	defer sa.Close()
	sb, err := b.SessionFromMetadata(blobA)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := sa.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.SessionFromMetadata(blobB[:len(blobB)/2]); !errorsIsAny(err, StatusProtocol, StatusDuplicate) {
		t.Fatalf("a truncated blob: %v", err)
	}
	if err := sa.Notify([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	msg, err := sb.WaitNotification(ctx)
	if err != nil || string(msg) != "hello" {
		t.Fatalf("notification %q, %v", msg, err)
	}
}
