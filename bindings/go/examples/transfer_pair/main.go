// Command transfer_pair is the smallest complete SmartGen transfer in Go, in two processes on one
// host: what examples/c/transfer_pair.c does, with package smartgen.
//
//	prefill (parent)                               decode (child, this program re-run)
//	context, listener on 127.0.0.1:0
//	start the child with the port  --------------> context (its own)
//	Accept  <------------------ bootstrap -------- Connect
//	register + export the source pool              register + export the destination pool
//	Post("req-1", blocks A)                        Expect("req-1", blocks B)
//	LayerWritten(0), (1), ...                      WaitLayer(0), (1), ..., then check every byte
//	Wait, print stats, exit with the child's verdict
//
// Both sides use the same layout (2 layers, 2 KV heads, head_dim 64, 16 tokens per block, fp16,
// K and V separate, 32 blocks per layer) but put the request's tokens in different blocks: the
// runtime maps prefill's block table onto decode's.
//
// Go has no fork, so the decode side is this program started again (os/exec), the way a Go
// service would start a worker. The parent makes a random session key and hands it to the child
// through a pipe (fd 3), so it never touches the disk; separate hosts would read the same key
// from a secret store, or name its file in SG_AUTH_KEY_FILE.
//
// Usage: transfer_pair [--provider NAME]   (NAME as ContextOptions.Provider; default auto)
// Exit status: 0 when decode received exactly the bytes prefill wrote, 1 otherwise.
package main

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"time"

	smartgen "github.com/smartgen/smartgen/bindings/go"
)

var layout = smartgen.Layout{
	NumLayers: 2, NumKVHeads: 2, HeadDim: 64, TokensPerBlock: 16, NumBlocks: 32,
	DType: smartgen.FP16, Packing: smartgen.Separate, BlockOrder: smartgen.TokenMajor,
}

const (
	numTokens  = 100 // 7 blocks: 6 full, the last holds 4 tokens
	tokenElems = 2 * 64
	requestID  = "req-1"
	timeout    = 5 * time.Second // accept, connect, every transfer wait
	keyBytes   = 32

	// Fill values outside the request, so a block written where it should not be is noticed.
	prefillFill = 0xDEAD
	decodeFill  = 0xBEEF
)

// Where the request's blocks live on each side: same tokens, different (unordered) block ids.
var (
	prefillBlocks = []uint32{1, 2, 20, 21, 7, 30, 4}
	decodeBlocks  = []uint32{5, 3, 9, 0, 31, 17, 12}
)

// pattern is the value of element elem of token t in K (kv 0) or V (kv 1) of a layer: any
// function of the four would do; this one differs in every argument.
func pattern(layer, kv, token, elem uint32) uint16 {
	x := layer*0x9E37 + kv*0x7F4B + token*0x0131 + elem*0x0007
	return uint16((x ^ (x >> 7)) & 0xFFFF)
}

// element is the fp16 bit pattern (host order) of token t's element in a token-major plane.
func element(region []byte, blocks []uint32, token, elem uint32) []byte {
	block, slot := blocks[token/layout.TokensPerBlock], token%layout.TokensPerBlock
	planeElems := layout.TokensPerBlock * tokenElems
	off := 2 * (int(block)*int(planeElems) + int(slot*tokenElems+elem))
	return region[off : off+2]
}

func regions(p *smartgen.Pool, l int) [2][]byte { return [2][]byte{p.K(l), p.V(l)} }

func fill(p *smartgen.Pool, value uint16) {
	for l := 0; l < int(layout.NumLayers); l++ {
		for _, r := range regions(p, l) {
			for o := 0; o < len(r); o += 2 {
				binary.LittleEndian.PutUint16(r[o:], value)
			}
		}
	}
}

func newPool(c *smartgen.Context, value uint16) (*smartgen.Pool, *smartgen.KV) {
	p, err := smartgen.NewPool(layout)
	check(err)
	fill(p, value)
	kv, err := c.Register(p)
	check(err)
	return p, kv
}

var role = "main"

func check(err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "[%s] %v\n", role, err)
		os.Exit(1)
	}
}

func runPrefill(provider string) int {
	role = "prefill"
	key := make([]byte, keyBytes)
	_, err := rand.Read(key)
	check(err)
	c, err := smartgen.NewContext(smartgen.ContextOptions{Provider: provider, AuthKey: key})
	check(err)
	defer c.Close()
	name, err := c.Provider()
	check(err)
	// Port 0: the kernel picks a free port, so parallel runs (ctest -j) do not collide.
	l, err := c.Listen("127.0.0.1", 0)
	check(err)
	fmt.Printf("[prefill] context on %s, listening on 127.0.0.1:%d\n", name, l.Port())

	child, err := startDecode(provider, l.Port(), key)
	check(err)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s, err := l.Accept(ctx)
	if err != nil {
		child.Process.Kill()
		child.Wait()
		check(err)
	}
	defer s.Close()
	l.Close() // one peer is all this program expects; the session outlives its listener

	pool, kv := newPool(c, prefillFill)
	defer pool.Close()
	defer kv.Close()
	for l := uint32(0); l < layout.NumLayers; l++ {
		for kvp, r := range regions(pool, int(l)) {
			for t := uint32(0); t < numTokens; t++ {
				for e := uint32(0); e < tokenElems; e++ {
					binary.LittleEndian.PutUint16(element(r, prefillBlocks, t, e), pattern(l, uint32(kvp), t, e))
				}
			}
		}
	}
	check(s.Export(kv))

	// No AllLayersWritten: nothing is sent until layers are marked written, as a prefill engine
	// marks each layer when its forward pass finishes it.
	x, err := s.Post(requestID, kv, prefillBlocks, numTokens, smartgen.TransferOptions{})
	check(err)
	defer x.Release()
	for l := uint32(0); l < layout.NumLayers; l++ {
		check(x.LayerWritten(l))
	}
	// Prefill completes when every byte is delivered and acknowledged by decode.
	check(x.Wait(ctx))
	st, err := x.Stats()
	check(err)
	fmt.Printf("[prefill] %s: %d bytes in %d RMA ops (%d segments, %d staged bytes), %.1f us\n", requestID,
		st.Bytes, st.RMAOps, st.Segments, st.StagedBytes, float64(st.EndNs-st.StartNs)/1e3)

	// The child's exit status is the verdict on the bytes.
	err = child.Wait()
	verdict := "PASS"
	if err != nil {
		verdict = "FAIL"
	}
	fmt.Printf("[prefill] decode exited with %d: %s\n", child.ProcessState.ExitCode(), verdict)
	if err != nil {
		return 1
	}
	return 0
}

// startDecode runs this program again as the decode side; the key goes down a pipe (fd 3).
func startDecode(provider string, port uint16, key []byte) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	cmd := exec.Command(self, "--provider", provider, "--decode-port", strconv.Itoa(int(port)))
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.ExtraFiles = []*os.File{r}
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, err
	}
	_, err = w.Write(key)
	w.Close()
	return cmd, err
}

func runDecode(provider string, port uint16) int {
	role = "decode"
	key := make([]byte, keyBytes)
	_, err := io.ReadFull(os.NewFile(3, "key"), key)
	check(err)
	c, err := smartgen.NewContext(smartgen.ContextOptions{Provider: provider, AuthKey: key})
	check(err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s, err := c.Connect(ctx, "127.0.0.1", port)
	check(err)
	defer s.Close()
	pool, kv := newPool(c, decodeFill)
	defer pool.Close()
	defer kv.Close()
	check(s.Export(kv))

	x, err := s.Expect(requestID, kv, decodeBlocks, numTokens, smartgen.TransferOptions{})
	check(err)
	defer x.Release()
	for l := uint32(0); l < layout.NumLayers; l++ {
		check(x.WaitLayer(ctx, l))
		fmt.Printf("[decode] layer %d ready\n", l)
	}
	check(x.Wait(ctx))

	bad := verify(pool)
	if bad == 0 {
		fmt.Printf("[decode] %s: all %d tokens x %d layers x K/V match\n", requestID, numTokens, layout.NumLayers)
		return 0
	}
	fmt.Printf("[decode] %s: %d mismatches\n", requestID, bad)
	return 1
}

// verify counts the elements of the request that differ from the pattern, and the elements of
// blocks outside the request that are not the decode fill. (Slots of the last block past
// numTokens are not checked: the header does not say whether whole blocks move.)
func verify(p *smartgen.Pool) int {
	bad := 0
	inRequest := map[uint32]bool{}
	for _, b := range decodeBlocks {
		inRequest[b] = true
	}
	planeBytes := int(layout.TokensPerBlock) * tokenElems * 2
	for l := uint32(0); l < layout.NumLayers; l++ {
		for kvp, r := range regions(p, int(l)) {
			for t := uint32(0); t < numTokens; t++ {
				for e := uint32(0); e < tokenElems; e++ {
					if binary.LittleEndian.Uint16(element(r, decodeBlocks, t, e)) != pattern(l, uint32(kvp), t, e) {
						bad++
					}
				}
			}
			for b := uint32(0); b < uint32(layout.NumBlocks); b++ {
				if inRequest[b] {
					continue
				}
				for o := int(b) * planeBytes; o < int(b+1)*planeBytes; o += 2 {
					if binary.LittleEndian.Uint16(r[o:]) != decodeFill {
						bad++
					}
				}
			}
		}
	}
	return bad
}

func main() {
	provider := flag.String("provider", "", "provider, as ContextOptions.Provider (\"tcp\", \"shm\", ...); default automatic")
	decodePort := flag.Int("decode-port", 0, "internal: run as the decode side, connecting to this port")
	flag.Parse()
	if *decodePort != 0 {
		os.Exit(runDecode(*provider, uint16(*decodePort)))
	}
	os.Exit(runPrefill(*provider))
}
