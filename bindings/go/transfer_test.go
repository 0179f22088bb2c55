package smartgen

import (
	"context"
	"errors"
	"testing"
	"time"
)

var (
	prefillTable = []uint32{1, 2, 20, 21, 7, 30, 4}
	decodeTable  = []uint32{5, 3, 9, 0, 31, 17, 12}
)

func TestTransferPairMovesEveryByte(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	// Whole blocks are compared, so the request covers them whole on both sides.
	const tokens = 7 * 16
	fillBlocks(p.prefillPool, prefillTable, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	dst, err := p.decodeSess.Expect("req-1", p.decodeKV, decodeTable, tokens, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	// Options that go through the shim for the call only: the layer order is Go memory.
	src, err := p.prefillSession.Post("req-1", p.prefillKV, prefillTable, tokens,
		TransferOptions{LayerOrder: []uint32{1, 0}, Priority: 5, Deadline: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	for l := uint32(0); l < testLayout.NumLayers; l++ {
		if err := src.LayerWritten(l); err != nil {
			t.Fatal(err)
		}
	}
	for l := uint32(0); l < testLayout.NumLayers; l++ {
		if err := dst.WaitLayer(ctx, l); err != nil {
			t.Fatalf("layer %d: %v", l, err)
		}
	}
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if bad := checkBlocks(p.decodePool, decodeTable, 0); bad != "" {
		t.Fatal(bad)
	}
	state, err := dst.LayerState(0)
	if err != nil || state&StateReady == 0 {
		t.Fatalf("layer 0 state %#x, %v", state, err)
	}
	stats, err := src.Stats()
	if err != nil {
		t.Fatal(err)
	}
	want := uint64(testLayout.NumLayers) * 2 * 7 * 4096
	if stats.BytesFull != want {
		t.Errorf("prefill stats: %d full-path bytes, want %d", stats.BytesFull, want)
	}
	if st, _, err := dst.Status(); err != nil || st != StatusOK {
		t.Errorf("decode status %v, %v", st, err)
	}
	cs, err := p.prefill.Stats()
	if err != nil || cs.TransfersCompleted != 1 || cs.SessionsOpen != 1 {
		t.Errorf("prefill context stats %+v, %v", cs, err)
	}
}

// A transfer whose deadline passes fails in the background; its wait reports StatusDeadline with
// the detail the transfer recorded.
func TestMissedDeadlineIsTheTransfersError(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	x, err := p.decodeSess.Expect("late", p.decodeKV, []uint32{4}, 16, TransferOptions{Deadline: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = x.Wait(ctx)
	var e *Error
	if !errors.As(err, &e) || e.Status() != StatusDeadline || e.Message == "" {
		t.Fatalf("wait of a transfer past its deadline: %v", err)
	}
	if st, detail, err := x.Status(); err != nil || st != StatusDeadline || detail == "" {
		t.Fatalf("Status: %v %q %v", st, detail, err)
	}
}

// In-flight quantization: both sides ask for int8, every pool byte goes quantized, and the wire
// carries about half of fp16's (codes plus a scale per block, plane and KV head).
func TestQuantizedTransferHalvesTheWireBytes(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	const tokens = 7 * 16
	fillBlocks(p.prefillPool, prefillTable, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	opts := TransferOptions{WireQuant: WireQuantInt8}
	dst, err := p.decodeSess.Expect("q", p.decodeKV, decodeTable, tokens, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	opts.Flags = AllLayersWritten
	src, err := p.prefillSession.Post("q", p.prefillKV, prefillTable, tokens, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	stats, err := dst.Stats()
	if err != nil {
		t.Fatal(err)
	}
	want := uint64(testLayout.NumLayers) * 2 * 7 * 4096
	if stats.QuantizedBytes != want || stats.QuantizedWireBytes*100 > want*51 || stats.QuantizedWireBytes*2 < want {
		t.Errorf("quantized %d pool bytes into %d wire bytes, want %d into about half", stats.QuantizedBytes,
			stats.QuantizedWireBytes, want)
	}
}
