package smartgen

import (
	"context"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// A pool over memory the host owns, as a serving engine owns its KV cache: here mmapped outside
// the Go heap, with fused K+V and a padded block stride, registered from its addresses. A transfer
// from a package-made pool lands in it byte for byte, and closing the pool leaves the memory to
// its owner.
func TestAPoolOverEngineOwnedMemoryFusedAndPadded(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	fillBlocks(p.prefillPool, prefillTable, 9)
	plane, err := testLayout.PlaneBytes()
	if err != nil {
		t.Fatal(err)
	}
	layout := testLayout
	layout.Packing = Fused
	layout.BlockStrideBytes = 2*plane + 256 // padding after each block's K and V planes
	region := layout.BlockStrideBytes * layout.NumBlocks
	var regions [][]byte
	mem := Memory{Kind: MemHost}
	for l := uint32(0); l < layout.NumLayers; l++ {
		b, err := syscall.Mmap(-1, 0, int(region), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		for i := range b {
			b[i] = 0xEE // the padding must stay as the engine left it
		}
		regions = append(regions, b)
		mem.K = append(mem.K, unsafe.Pointer(&b[0]))
	}
	defer func() {
		for _, b := range regions {
			_ = syscall.Munmap(b)
		}
	}()
	pool, err := NewPoolFromMemory(layout, mem)
	if err != nil {
		t.Fatal(err)
	}
	if pool.RegionBytes() != region {
		t.Fatalf("RegionBytes %d, want %d", pool.RegionBytes(), region)
	}
	kv, err := p.decode.Register(pool)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.decodeSess.Export(kv); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dst, err := p.decodeSess.Expect("engine-memory", kv, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	src, err := p.prefillSession.Post("engine-memory", p.prefillKV, prefillTable, 7*16, TransferOptions{Flags: AllLayersWritten})
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	dst.Release()
	src.Release()
	// Logical block i went from prefillTable[i] to decodeTable[i]: K then V inside the fused block.
	for l := 0; l < int(layout.NumLayers); l++ {
		for i := range prefillTable {
			from := int(prefillTable[i]) * int(plane)
			at := int(decodeTable[i]) * int(layout.BlockStrideBytes)
			got := regions[l][at : at+int(layout.BlockStrideBytes)]
			if string(got[:plane]) != string(p.prefillPool.K(l)[from:from+int(plane)]) ||
				string(got[plane:2*plane]) != string(p.prefillPool.V(l)[from:from+int(plane)]) {
				t.Fatalf("layer %d logical block %d differs in the engine's memory", l, i)
			}
			for o, c := range got[2*plane:] {
				if c != 0xEE {
					t.Fatalf("layer %d block %d: padding byte %d written", l, decodeTable[i], o)
				}
			}
		}
	}
	if pool.K(0) == nil || &pool.K(0)[0] != &regions[0][0] {
		t.Fatal("K(0) is not a view of the engine's memory")
	}
	if err := kv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
	regions[0][0] = 1 // still the engine's, still mapped after Close
	if _, err := NewPoolFromMemory(testLayout, Memory{K: mem.K}); err == nil {
		t.Fatal("Separate packing without V addresses was accepted")
	}
}
