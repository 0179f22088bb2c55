package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"
	"unsafe"

	smartgen "github.com/smartgen/smartgen/bindings/go"
)

var stderr = os.Stderr

// run is everything one side holds, so that cleanup can release whatever exists on any path.
type run struct {
	cfg     *config
	n       uint32   // blocks of the request: tokens / 16
	table   []uint32 // this side's block table
	ramp    []byte
	pool    *smartgen.Pool
	regions [][]byte // the memory this program allocated for the pool, as an engine owns its cache
	ctx     *smartgen.Context
	kv      *smartgen.KV
	session *smartgen.Session
	profile *smartgen.Profile
	xfer    [2]*smartgen.Transfer

	bytes   uint64
	fullS   float64
	callsNs float64
}

// bounded is a context.Context for one wait of --timeout-s.
func (r *run) bounded() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), r.cfg.timeout)
}

// waitErr says a wait that ran out of --timeout-s as such; other errors are the transfer's own.
func (r *run) waitErr(err error, call string, req int) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fail("SG_ERR_TIMEOUT", "%s(%s): not done within --timeout-s %d", call, requestIDs[req], r.cfg.timeoutS)
	}
	return err
}

func (r *run) execute() (err error) {
	c := r.cfg
	r.n = c.tokens / blockTokens
	stride, offset := uint32(decodeStride), uint32(decodeOffset)
	if c.prefill {
		stride, offset = prefillStride, prefillOffset
	}
	r.table = make([]uint32, r.n)
	for i := range r.table {
		r.table[i] = uint32((uint64(i)*uint64(stride) + uint64(offset)) % uint64(c.blocks))
	}
	r.ramp = newRamp()
	defer func() {
		if cerr := r.cleanup(); err == nil {
			err = cerr
		}
	}()
	if err = r.makePool(); err != nil {
		return err
	}
	// The prefill side writes request 0 before it has a session, so the decode side's full_s
	// (from its expect) counts the transfer and the ready round trip, not the peer's writing.
	if c.prefill {
		r.fillRequest(reqFull)
	}
	// Provider tcp;ofi_rxm, local_addr 127.0.0.1, the key from SG_AUTH_KEY_FILE, the rest default.
	if r.ctx, err = smartgen.NewContext(smartgen.ContextOptions{Provider: "tcp"}); err != nil {
		return err
	}
	if r.kv, err = r.ctx.Register(r.pool); err != nil {
		return err
	}
	if err = r.openSession(); err != nil {
		return err
	}
	if c.prefill {
		err = r.runPrefill()
	} else {
		err = r.runDecode()
	}
	if err != nil {
		return err
	}
	// Graceful: returns once the peer has read everything this side sent.
	ctx, cancel := r.bounded()
	defer cancel()
	return r.session.Shutdown(ctx)
}

// makePool registers memory this program mapped itself (one K and one V region per layer), the way
// a serving engine registers the KV cache it owns; cleanup unmaps it after the pool is closed.
func (r *run) makePool() error {
	c := r.cfg
	layout := smartgen.Layout{
		NumLayers: c.layers, NumKVHeads: kvHeads, HeadDim: headDim, TokensPerBlock: blockTokens,
		NumBlocks: uint64(c.blocks), DType: smartgen.FP16, Packing: smartgen.Separate,
		BlockOrder: smartgen.TokenMajor,
	}
	regionBytes := int(c.blocks) * blockTokens * kvHeads * headDim * 2
	mem := smartgen.Memory{Kind: smartgen.MemHost}
	for l := 0; l < int(c.layers); l++ {
		for plane := 0; plane < 2; plane++ {
			b, err := syscall.Mmap(-1, 0, regionBytes, syscall.PROT_READ|syscall.PROT_WRITE,
				syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
			if err != nil {
				return fail("SG_ERR_NO_MEMORY", "mmap of a %d-byte region: %v", regionBytes, err)
			}
			r.regions = append(r.regions, b)
			if plane == 0 {
				mem.K = append(mem.K, unsafe.Pointer(&b[0]))
			} else {
				mem.V = append(mem.V, unsafe.Pointer(&b[0]))
			}
		}
	}
	var err error
	r.pool, err = smartgen.NewPoolFromMemory(layout, mem)
	return err
}

func (r *run) openSession() error {
	ctx, cancel := r.bounded()
	defer cancel()
	if r.cfg.listen {
		l, err := r.ctx.Listen(r.cfg.addr, r.cfg.port)
		if err != nil {
			return err
		}
		// One peer is all this program takes; the session outlives its listener.
		defer l.Close()
		r.progress("listening on %s:%d", r.cfg.addr, l.Port())
		if r.session, err = l.Accept(ctx); err != nil {
			return err
		}
	} else {
		// The two programs start independently, so the listener may not be up yet: a refused
		// connect is retried until --timeout-s; any other failure is final.
		for {
			s, err := r.ctx.Connect(ctx, r.cfg.addr, r.cfg.port)
			if err == nil {
				r.session = s
				break
			}
			if !errors.Is(err, smartgen.StatusConnect) {
				return err
			}
			dl, _ := ctx.Deadline()
			if time.Until(dl) < connectRetry {
				return err
			}
			time.Sleep(connectRetry)
		}
	}
	// Right after the session is made, as the spec says: the peer can address our pool from now on.
	if err := r.session.Export(r.kv); err != nil {
		return err
	}
	provider, err := r.session.Provider()
	if err != nil {
		return err
	}
	r.progress("session with %s:%d over %s", r.cfg.addr, r.cfg.port, provider)
	return nil
}

// awaitReady (prefill) waits for the decode side's "ready <id>".
func (r *run) awaitReady(req int) error {
	want := readyPrefix + requestIDs[req]
	ctx, cancel := r.bounded()
	defer cancel()
	got, err := r.session.WaitNotification(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		return fail("SG_ERR_TIMEOUT", "no '%s' notification within --timeout-s %d", want, r.cfg.timeoutS)
	}
	if err != nil {
		return err
	}
	// A peer that sends a trailing NUL is read as one that does not.
	if len(got) > 0 && got[len(got)-1] == 0 {
		got = got[:len(got)-1]
	}
	if string(got) != want {
		if len(got) > 200 {
			got = got[:200]
		}
		return fail("SG_ERR_PROTOCOL", "expected the notification '%s', got '%s'", want, got)
	}
	return nil
}

func (r *run) postRequest(req int) error {
	if err := r.awaitReady(req); err != nil {
		return err
	}
	opts := smartgen.TransferOptions{Flags: smartgen.AllLayersWritten, Paths: smartgen.PathFull}
	if req == reqSelective {
		opts.Paths = smartgen.PathProactive | smartgen.PathOnDemand | smartgen.PathSpeculative
		opts.Profile = r.profile
	}
	start := time.Now()
	x, err := r.session.Post(requestIDs[req], r.kv, r.table, uint64(r.cfg.tokens), opts)
	if err != nil {
		return err
	}
	r.xfer[req] = x
	ctx, cancel := r.bounded()
	defer cancel()
	// Complete only once the decode side confirmed every byte in place.
	if err := r.waitErr(x.Wait(ctx), "sg_transfer_wait", req); err != nil {
		return err
	}
	if req == reqFull {
		r.fullS = time.Since(start).Seconds()
	}
	r.bytes += r.requestBytes()
	r.progress("%s delivered and confirmed", requestIDs[req])
	// Released at once: the blocks are refilled for the next request.
	r.xfer[req] = nil
	return x.Release()
}

func (r *run) runPrefill() error {
	if err := r.postRequest(reqFull); err != nil {
		return err
	}
	if !r.cfg.selective {
		return nil
	}
	r.fillRequest(reqSelective)
	var err error
	if r.profile, err = smartgen.ParseProfile(fmt.Sprintf(profileFormat, r.cfg.layers)); err != nil {
		return err
	}
	return r.postRequest(reqSelective)
}

// expectRequest (decode) clears the destination, expects, then tells the prefill side to post.
func (r *run) expectRequest(req int) (time.Time, error) {
	r.clearRequest()
	// Default options: the decode side follows the paths of the post, learned at the match.
	start := time.Now()
	x, err := r.session.Expect(requestIDs[req], r.kv, r.table, uint64(r.cfg.tokens), smartgen.TransferOptions{})
	if err != nil {
		return start, err
	}
	r.xfer[req] = x
	// Sent without a NUL: the message is its bytes.
	return start, r.session.Notify([]byte(readyPrefix + requestIDs[req]))
}

func (r *run) receiveFull() error {
	start, err := r.expectRequest(reqFull)
	if err != nil {
		return err
	}
	ctx, cancel := r.bounded()
	defer cancel()
	if err := r.waitErr(r.xfer[reqFull].Wait(ctx), "sg_transfer_wait", reqFull); err != nil {
		return err
	}
	r.fullS = time.Since(start).Seconds()
	if err := r.verifyRequest(reqFull); err != nil {
		return err
	}
	r.progress("%s: every byte checked (%.3f s)", requestIDs[reqFull], r.fullS)
	return nil
}

func (r *run) receiveSelective() error {
	start, err := r.expectRequest(reqSelective)
	if err != nil {
		return err
	}
	x := r.xfer[reqSelective]
	ctx, cancel := r.bounded()
	defer cancel()
	for l := uint32(0); l < r.cfg.layers; l++ {
		if err := r.waitErr(x.WaitLayerState(ctx, l, smartgen.StateEssential),
			"sg_transfer_wait_layer_state(SG_LAYER_ESSENTIAL)", reqSelective); err != nil {
			return err
		}
	}
	fetch := []uint32{1, r.n / 2, r.n - 2}
	if err := x.Fetch(0, fetch); err != nil {
		return err
	}
	if err := r.waitErr(x.WaitBlocks(ctx, 0, fetch), "sg_transfer_wait_blocks", reqSelective); err != nil {
		return err
	}
	// The speculative path brings whatever the proactive path and the fetch did not.
	if err := r.waitErr(x.Wait(ctx), "sg_transfer_wait", reqSelective); err != nil {
		return err
	}
	if err := r.verifyRequest(reqSelective); err != nil {
		return err
	}
	stats, err := x.Stats()
	if err != nil {
		return err
	}
	r.progress("%s: every byte checked (%.3f s); bytes proactive %d, on demand %d, speculative %d; %d fetch requests",
		requestIDs[reqSelective], time.Since(start).Seconds(), stats.BytesProactive, stats.BytesOnDemand,
		stats.BytesSpeculative, stats.FetchRequests)
	r.xfer[reqSelective] = nil
	return x.Release()
}

// measureCalls times the binding's cost of one call: a non-blocking query on a live, completed
// transfer.
func (r *run) measureCalls() error {
	x := r.xfer[reqFull]
	var state smartgen.LayerState
	var err error
	start := time.Now()
	for i := uint64(0); i < r.cfg.calls && err == nil; i++ {
		state, err = x.LayerState(0)
	}
	if err != nil {
		return err
	}
	r.callsNs = float64(time.Since(start).Nanoseconds()) / float64(r.cfg.calls)
	if state&smartgen.StateReady == 0 {
		return fail("SG_ERR_INVALID_STATE", "layer 0 of a completed transfer reads state %#x", uint32(state))
	}
	r.progress("%d calls of LayerState (sg_transfer_layer_state): %.1f ns each", r.cfg.calls, r.callsNs)
	return nil
}

func (r *run) runDecode() error {
	if err := r.receiveFull(); err != nil {
		return err
	}
	if r.cfg.selective {
		if err := r.receiveSelective(); err != nil {
			return err
		}
	}
	if r.cfg.calls > 0 {
		if err := r.measureCalls(); err != nil {
			return err
		}
	}
	x := r.xfer[reqFull]
	r.xfer[reqFull] = nil
	return x.Release()
}

// cleanup runs on every path, in the reverse order of creation: transfers (they use the pool),
// profile, session, pool registration, context, then the memory the registration pointed to. On
// the success path the session was closed gracefully first; on a failure it is closed at once,
// which cancels what is left. Its first error is returned (a failure before it is reported
// instead); the others are logged.
func (r *run) cleanup() error {
	var first error
	note := func(err error) {
		if err == nil {
			return
		}
		r.progress("cleanup: %s", reason(err))
		if first == nil {
			first = err
		}
	}
	for i := len(r.xfer) - 1; i >= 0; i-- {
		if r.xfer[i] != nil {
			note(r.xfer[i].Release())
		}
	}
	if r.profile != nil {
		note(r.profile.Close())
	}
	if r.session != nil {
		note(r.session.Close())
	}
	if r.kv != nil {
		note(r.kv.Close())
	}
	if r.ctx != nil {
		note(r.ctx.Close())
	}
	poolClosed := true
	if r.pool != nil {
		perr := r.pool.Close()
		note(perr)
		poolClosed = perr == nil
	}
	// Only once the pool is closed: until then the library may still address the memory.
	if poolClosed {
		for _, b := range r.regions {
			note(syscall.Munmap(b))
		}
	}
	return first
}
