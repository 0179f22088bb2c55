// Command selective moves one request's KV over the selective paths, in one process with two
// contexts (prefill and decode) joined by a session on 127.0.0.1:
//
//   - proactive: as each layer is written, the prefill side sends the blocks the profile calls
//     essential (here: attention sinks, the recent window, 1/8 of the blocks) and the layer's
//     page digests;
//   - on demand: the decode side fetches blocks it wants before the rest arrive;
//   - speculative: whatever has not been sent follows in the background, at the lowest priority.
//
// The decode side follows it through events (a goroutine reads Context.Events and asks the
// transfer for its residency), waits for each layer's essential set, fetches three blocks of
// layer 0, then waits for the whole request and checks every byte.
//
// Usage: selective [--provider NAME] [--profile FILE]   (a profile file as docs/profiles.md; the
// default is the built-in sinks+recent profile below)
// Exit status: 0 when the decode side holds exactly the prefill side's bytes, 1 otherwise.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"math/bits"
	"os"
	"sync"
	"time"

	smartgen "github.com/smartgen/smartgen/bindings/go"
)

var layout = smartgen.Layout{
	NumLayers: 4, NumKVHeads: 8, HeadDim: 128, TokensPerBlock: 16, NumBlocks: 80,
	DType: smartgen.FP16, Packing: smartgen.Separate, BlockOrder: smartgen.TokenMajor,
}

const (
	numTokens  = 1024 // 64 blocks
	planeBytes = 16 * 8 * 128 * 2
	requestID  = "selective-1"
	timeout    = 20 * time.Second
)

const builtinProfile = `{"version":1,"model":"example","num_layers":4,"num_kv_heads":8,"block_tokens":16,
  "defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}`

// Block tables: logical block i of the request lives at a different physical block on each side.
func table(stride, offset uint32) []uint32 {
	t := make([]uint32, numTokens/16)
	for i := range t {
		t[i] = (uint32(i)*stride + offset) % uint32(layout.NumBlocks)
	}
	return t
}

func plane(p *smartgen.Pool, layer, kv int, block uint32) []byte {
	r := p.K(layer)
	if kv == 1 {
		r = p.V(layer)
	}
	return r[int(block)*planeBytes : int(block+1)*planeBytes]
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "selective:", err)
		os.Exit(1)
	}
}

func main() {
	provider := flag.String("provider", "", "provider, as ContextOptions.Provider; default automatic")
	profileFile := flag.String("profile", "", "profile file (docs/profiles.md); default: sinks + recent, 1/8")
	flag.Parse()
	os.Exit(run(*provider, *profileFile))
}

func run(provider, profileFile string) int {
	key := make([]byte, 32)
	_, err := rand.Read(key)
	must(err)
	prefill, err := smartgen.NewContext(smartgen.ContextOptions{Provider: provider, AuthKey: key})
	must(err)
	defer prefill.Close()
	decode, err := smartgen.NewContext(smartgen.ContextOptions{Provider: provider, AuthKey: key, EventBuffer: 256})
	must(err)
	defer decode.Close()

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	l, err := prefill.Listen("127.0.0.1", 0)
	must(err)
	accepted := make(chan *smartgen.Session, 1)
	go func() {
		s, err := l.Accept(ctx)
		must(err)
		accepted <- s
	}()
	dsess, err := decode.Connect(ctx, "127.0.0.1", l.Port())
	must(err)
	defer dsess.Close()
	psess := <-accepted
	defer psess.Close()
	l.Close()

	src, srcKV := pool(prefill, psess)
	defer src.Close()
	defer srcKV.Close()
	dst, dstKV := pool(decode, dsess)
	defer dst.Close()
	defer dstKV.Close()
	srcTable, dstTable := table(37, 11), table(29, 5)
	for layer := 0; layer < int(layout.NumLayers); layer++ {
		for kv := 0; kv < 2; kv++ {
			for _, b := range srcTable {
				_, err := rand.Read(plane(src, layer, kv, b))
				must(err)
			}
		}
	}

	var profile *smartgen.Profile
	if profileFile != "" {
		profile, err = smartgen.LoadProfile(profileFile)
	} else {
		profile, err = smartgen.ParseProfile(builtinProfile)
	}
	must(err)
	defer profile.Close()

	// The events goroutine: what arrived, and how much of each layer is resident at that moment.
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ev := range decode.Events() {
			x := ev.Transfer()
			if x == nil {
				continue
			}
			switch ev.Kind {
			case smartgen.EventEssentialReady, smartgen.EventBlocksReady, smartgen.EventLayerReady:
				bitmap, n, err := x.Residency(ev.Layer)
				if err != nil {
					fmt.Println("[events] residency:", err)
					continue
				}
				fmt.Printf("[events] %s layer %d %v: %d of %d blocks resident\n", ev.Kind, ev.Layer, ev.Blocks,
					popcount(bitmap), n)
			case smartgen.EventFinished:
				fmt.Printf("[events] %s: %v\n", ev.Kind, ev.Status)
			}
		}
	}()

	x, err := dsess.Expect(requestID, dstKV, dstTable, numTokens, smartgen.TransferOptions{})
	must(err)
	defer x.Release()
	post, err := psess.Post(requestID, srcKV, srcTable, numTokens, smartgen.TransferOptions{
		Paths:   smartgen.PathProactive | smartgen.PathOnDemand | smartgen.PathSpeculative,
		Profile: profile,
	})
	must(err)
	defer post.Release()
	// The engine marks each layer as its forward pass finishes it.
	for layer := uint32(0); layer < layout.NumLayers; layer++ {
		must(post.LayerWritten(layer))
	}

	// Decode: every layer's essential set first (enough to start attending), then the blocks a
	// step wants now, then the rest.
	for layer := uint32(0); layer < layout.NumLayers; layer++ {
		must(x.WaitLayerState(ctx, layer, smartgen.StateEssential))
	}
	want := []uint32{10, 20, 30}
	must(x.Fetch(0, want))
	must(x.WaitBlocks(ctx, 0, want))
	must(x.Wait(ctx))
	must(post.Wait(ctx))

	for layer := 0; layer < int(layout.NumLayers); layer++ {
		for kv := 0; kv < 2; kv++ {
			for i := range srcTable {
				if !bytes.Equal(plane(src, layer, kv, srcTable[i]), plane(dst, layer, kv, dstTable[i])) {
					fmt.Printf("layer %d plane %d logical block %d differs\n", layer, kv, i)
					return 1
				}
			}
		}
	}
	st, err := x.Stats()
	must(err)
	fmt.Printf("%s: every byte in place; proactive %d B, on demand %d B (%d requests), speculative %d B, digests %d B\n",
		requestID, st.BytesProactive, st.BytesOnDemand, st.FetchRequests, st.BytesSpeculative, st.DigestBytes)
	must(x.Release())
	must(post.Release())
	must(decode.Close()) // closes the event channel: the events goroutine ends
	wg.Wait()
	return 0
}

func pool(c *smartgen.Context, s *smartgen.Session) (*smartgen.Pool, *smartgen.KV) {
	p, err := smartgen.NewPool(layout)
	must(err)
	kv, err := c.Register(p)
	must(err)
	must(s.Export(kv))
	return p, kv
}

func popcount(bitmap []byte) int {
	n := 0
	for _, b := range bitmap {
		n += bits.OnesCount8(b)
	}
	return n
}
