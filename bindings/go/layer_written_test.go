package smartgen

import (
	"context"
	"errors"
	"testing"
	"time"
)

// LayerWrittenEx (sg_transfer_layer_written_ex) drives a transfer layer by layer like
// LayerWritten; device queries on a host pool are refused with a typed error, not sent.
func TestLayerWrittenExDrivesATransferLayerByLayer(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	fillBlocks(p.prefillPool, prefillTable, 5)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dst, err := p.decodeSess.Expect("ex", p.decodeKV, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	src, err := p.prefillSession.Post("ex", p.prefillKV, prefillTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Release()
	err = src.LayerWrittenEx(0, LayerWrittenArgs{DeviceQueries: 0x1000, QueriesMem: MemCUDA, NumQueries: 1, NumQHeads: 2})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("device queries on a host pool: got %v, want a *Error", err)
	}
	for l := uint32(0); l < testLayout.NumLayers; l++ {
		if err := src.LayerWrittenEx(l, LayerWrittenArgs{}); err != nil {
			t.Fatalf("layer %d: %v", l, err)
		}
	}
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if msg := checkBlocks(p.decodePool, decodeTable, 5); msg != "" {
		t.Fatal(msg)
	}
}
