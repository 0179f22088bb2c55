package smartgen

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"testing"
	"time"
)

// testLayout is small: 2 layers, 2 KV heads, head_dim 64, fp16, 16 tokens per block, 32 blocks.
var testLayout = Layout{NumLayers: 2, NumKVHeads: 2, HeadDim: 64, TokensPerBlock: 16, NumBlocks: 32, DType: FP16}

// pair is two contexts with a session between them over tcp on 127.0.0.1, each with a pool
// registered and exported to its session.
type pair struct {
	prefill, decode            *Context
	prefillSession, decodeSess *Session
	prefillPool, decodePool    *Pool
	prefillKV, decodeKV        *KV
}

func testKey(t *testing.T) []byte {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	return key
}

func newPair(t *testing.T, key []byte, decodeOpts ContextOptions) *pair {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p := &pair{}
	var err error
	p.prefill, err = NewContext(ContextOptions{Provider: "tcp", AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.prefill.Close() })
	decodeOpts.Provider = "tcp"
	decodeOpts.AuthKey = key
	p.decode, err = NewContext(decodeOpts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.decode.Close() })

	l, err := p.prefill.Listen("127.0.0.1", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan error, 1)
	go func() {
		var err error
		p.prefillSession, err = l.Accept(ctx)
		accepted <- err
	}()
	p.decodeSess, err = p.decode.Connect(ctx, "127.0.0.1", l.Port())
	if err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.prefillSession.Close(); p.decodeSess.Close() })

	p.prefillPool, p.prefillKV = newRegisteredPool(t, p.prefill)
	p.decodePool, p.decodeKV = newRegisteredPool(t, p.decode)
	if err := p.prefillSession.Export(p.prefillKV); err != nil {
		t.Fatal(err)
	}
	if err := p.decodeSess.Export(p.decodeKV); err != nil {
		t.Fatal(err)
	}
	return p
}

func newRegisteredPool(t *testing.T, c *Context) (*Pool, *KV) {
	t.Helper()
	pool, err := NewPool(testLayout)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := c.Register(pool)
	if err != nil {
		t.Fatal(err)
	}
	// Cleanups run last-in first-out: the registration goes before the memory it points to.
	t.Cleanup(func() {
		if err := pool.Close(); err != nil {
			t.Errorf("pool close: %v", err)
		}
	})
	t.Cleanup(func() {
		if err := kv.Close(); err != nil {
			t.Errorf("kv close: %v", err)
		}
	})
	return pool, kv
}

// fillBlocks writes a pattern that differs per layer, plane, logical block and byte.
func fillBlocks(p *Pool, table []uint32, seed byte) {
	plane := int(p.RegionBytes() / p.Layout().NumBlocks)
	for l := 0; l < int(p.Layout().NumLayers); l++ {
		for kvp, region := range [][]byte{p.K(l), p.V(l)} {
			for i, b := range table {
				blk := region[int(b)*plane : (int(b)+1)*plane]
				for o := range blk {
					blk[o] = byte(l*131 + kvp*71 + i*29 + o*7 + int(seed))
				}
			}
		}
	}
}

// checkBlocks returns the first difference from fillBlocks' pattern, or "".
func checkBlocks(p *Pool, table []uint32, seed byte) string {
	plane := int(p.RegionBytes() / p.Layout().NumBlocks)
	for l := 0; l < int(p.Layout().NumLayers); l++ {
		for kvp, region := range [][]byte{p.K(l), p.V(l)} {
			for i, b := range table {
				blk := region[int(b)*plane : (int(b)+1)*plane]
				for o := range blk {
					if want := byte(l*131 + kvp*71 + i*29 + o*7 + int(seed)); blk[o] != want {
						return fmtMismatch(l, kvp, i, o, blk[o], want)
					}
				}
			}
		}
	}
	return ""
}

func interopProfileJSON(layers uint32) string {
	return fmt.Sprintf(`{"version":1,"model":"interop","num_layers":%d,"num_kv_heads":8,"block_tokens":16,`+
		`"defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}`, layers)
}

func fmtMismatch(layer, plane, block, off int, got, want byte) string {
	return fmt.Sprintf("layer %d plane %d logical block %d offset %d: got %#x, want %#x", layer, plane, block, off, got, want)
}

func errorsIsAny(err error, statuses ...Status) bool {
	for _, s := range statuses {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// exportAndMove exports each side's KV to its session, then moves request rid from ka
// (prefillTable) into kb (decodeTable), waits for both sides and releases them.
func exportAndMove(ctx context.Context, t *testing.T, sa, sb *Session, ka, kb *KV, rid string) {
	t.Helper()
	if err := sa.Export(ka); err != nil {
		t.Fatal(err)
	}
	if err := sb.Export(kb); err != nil {
		t.Fatal(err)
	}
	y, err := sb.Expect(rid, kb, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	x, err := sa.Post(rid, ka, prefillTable, 7*16, TransferOptions{Flags: AllLayersWritten})
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := x.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	y.Release()
	x.Release()
}
