package smartgen

import (
	"context"
	"time"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// Path is a set of transfer paths (SG_PATH_*). The zero value is PathFull.
type Path uint32

const (
	PathFull        Path = 0x1 // every block, layer by layer; excludes the others
	PathProactive   Path = 0x2 // each layer's essential blocks (by the profile) and page digests first
	PathOnDemand    Path = 0x4 // the decode side may Fetch blocks it lacks
	PathSpeculative Path = 0x8 // the rest in the background, at the lowest priority
)

// TransferFlag is a set of SG_TRANSFER_* flags.
type TransferFlag uint32

// AllLayersWritten (post): every layer is already written; send at once.
const AllLayersWritten TransferFlag = 0x1

// LayerState is a set of readiness bits of one layer (SG_LAYER_*).
type LayerState uint32

const (
	StateWritten   LayerState = 0x1 // prefill: the engine marked the layer written
	StateReady     LayerState = 0x2 // prefill: every byte delivered; decode: every byte in place
	StateEssential LayerState = 0x4 // proactive path: essential blocks and digests delivered / in place
)

// WireQuant is how the KV travels (SG_WIRE_QUANT_*): as the pools hold it, or as one-byte codes
// with a scale per block, plane and KV head (lossy; both sides must give the same value).
type WireQuant uint32

const (
	WireQuantNone    WireQuant = 0
	WireQuantInt8    WireQuant = 1
	WireQuantFP8E4M3 WireQuant = 2
)

// TransferOptions mirror sg_transfer_options_t; the zero value is the library's defaults.
type TransferOptions struct {
	Paths      Path // 0 = PathFull
	Flags      TransferFlag
	Priority   int32         // higher first among this context's transfers
	LayerOrder []uint32      // post: the order layers are sent in, a permutation of 0..NumLayers-1
	Deadline   time.Duration // from the call; 0 = none. Missed: the transfer fails with StatusDeadline
	Profile    *Profile      // post with PathProactive: decides the essential blocks; nil = sinks+recent
	Lease      time.Duration // post, selective paths: how long the blocks stay for fetches; 0 = until released
	WireQuant  WireQuant     // both sides the same; fp32/fp16/bf16 pools (since 0.3)
}

// Transfer is one request's KV on this side (sg_transfer_t): the decode side expects it, the
// prefill side posts it. Safe for concurrent use, also from the goroutine that receives events.
type Transfer struct {
	c         *Context
	h         uintptr
	requestID string
	life      lifecycle
}

// Expect (decode side) expects the KV of requestID from the peer into kv, at the blocks of the
// block table covering tokens tokens (sg_transfer_expect).
func (s *Session) Expect(requestID string, kv *KV, blocks []uint32, tokens uint64, opts TransferOptions) (*Transfer, error) {
	return s.start(0, "sg_transfer_expect", requestID, kv, blocks, tokens, opts)
}

// Post (prefill side) posts the KV of requestID from kv at the blocks of the block table
// (sg_transfer_post). Layers go as they are marked written (LayerWritten), or at once with
// AllLayersWritten.
func (s *Session) Post(requestID string, kv *KV, blocks []uint32, tokens uint64, opts TransferOptions) (*Transfer, error) {
	return s.start(1, "sg_transfer_post", requestID, kv, blocks, tokens, opts)
}

func (s *Session) start(post int, op, requestID string, kv *KV, blocks []uint32, tokens uint64,
	opts TransferOptions) (*Transfer, error) {
	if s == nil || kv == nil {
		return nil, newError(op, StatusInvalidArgument, "session or kv is nil")
	}
	profile, ok := opts.Profile.lock()
	defer opts.Profile.unlock()
	if !ok {
		return nil, closedError(op, "profile")
	}
	o := raw.NewSg_transfer_options_t()
	defer raw.DeleteSg_transfer_options_t(o)
	raw.Sg_transfer_options_init(o)
	o.SetPaths(uint32(opts.Paths))
	o.SetFlags(uint32(opts.Flags))
	o.SetPriority(opts.Priority)
	o.SetDeadline_ns(uint64(opts.Deadline))
	o.SetProfile(profile)
	o.SetLease_ns(uint64(opts.Lease))
	o.SetWire_quant(uint32(opts.WireQuant))
	var h uintptr
	err := s.life.call(s.c, op, "session", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_transfer_start(post, s.h, requestID, kv.h, firstOrNil(blocks), uint64(len(blocks)), tokens, o,
			firstOrNil(opts.LayerOrder), uint64(len(opts.LayerOrder)), &h, e)
	})
	if err != nil {
		return nil, err
	}
	t := &Transfer{c: s.c, h: h, requestID: requestID}
	if s.c.events != nil {
		// Only for Event.Transfer: a context without events keeps no reference to its transfers,
		// so nothing it holds points back at it and its finalizer can run (NewContext).
		s.c.transfers.Store(t.h, t)
	}
	return t, nil
}

// RequestID of the transfer.
func (t *Transfer) RequestID() string { return t.requestID }

func (t *Transfer) call(op string, fn func(e raw.Sg_error_info_t) int32) error {
	return t.life.call(t.c, op, "transfer", fn)
}

func (t *Transfer) wait(ctx context.Context, op string, fn func(timeout uint64, e raw.Sg_error_info_t) int32) error {
	return t.life.wait(ctx, t.c, op, "transfer", fn)
}

// LayerWritten (prefill) marks a layer written: the runtime may send it.
func (t *Transfer) LayerWritten(layer uint32) error {
	return t.call("sg_transfer_layer_written", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_layer_written(t.h, layer, e)
	})
}

// LayerWrittenQ is LayerWritten with the layer's last prompt queries (fp32
// [numQueries][numQHeads][headDim], after RoPE) for query-aware selection on the proactive path.
func (t *Transfer) LayerWrittenQ(layer uint32, queries []float32, numQueries, numQHeads uint32) error {
	var q *float32
	if len(queries) > 0 {
		q = &queries[0]
	}
	return t.call("sg_transfer_layer_written_q", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_layer_written_q(t.h, layer, q, numQueries, numQHeads, e)
	})
}

// LayerWrittenArgs is what a (device) engine says with a written layer
// (sg_transfer_layer_written_ex).
type LayerWrittenArgs struct {
	// The layer's last prompt queries, fp32 [NumQueries][NumQHeads][head_dim] after RoPE, for
	// query-aware selection: in host memory (Queries), or on the pool's CUDA device
	// (DeviceQueries, with QueriesMem MemCUDA). Neither: no queries.
	Queries       []float32
	DeviceQueries uintptr
	QueriesMem    MemKind
	NumQueries    uint32
	NumQHeads     uint32
	// CUDAStream is the cudaStream_t whose kernels write the layer (and the queries): the library
	// orders its reads after them. 0: the layer is already written.
	CUDAStream uintptr
}

// LayerWrittenEx is LayerWritten with the queries and the CUDA stream of a device engine.
func (t *Transfer) LayerWrittenEx(layer uint32, a LayerWrittenArgs) error {
	var q *float32
	if len(a.Queries) > 0 {
		q = &a.Queries[0]
	}
	return t.call("sg_transfer_layer_written_ex", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_transfer_layer_written_ex(t.h, layer, q, a.DeviceQueries, a.NumQueries, a.NumQHeads,
			uint32(a.QueriesMem), a.CUDAStream, e)
	})
}

// Test is nil when the transfer is complete, StatusInProgress (as an error value) while it runs,
// or the transfer's error.
func (t *Transfer) Test() error {
	var status int32
	err := t.call("sg_transfer_test", func(e raw.Sg_error_info_t) int32 {
		status = raw.Sgo_sg_transfer_test(t.h, e)
		return status
	})
	if err == nil && Status(status) == StatusInProgress {
		return StatusInProgress
	}
	return t.detail(err)
}

// Wait waits until the transfer is complete (prefill: the decode side confirmed every byte), it
// fails, or ctx ends (an error with StatusTimeout that matches ctx.Err(); the transfer goes on).
func (t *Transfer) Wait(ctx context.Context) error {
	return t.detail(t.wait(ctx, "sg_transfer_wait", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_wait(t.h, timeout, e)
	}))
}

// WaitLayer waits until one layer is ready (decode: every byte of it in place).
func (t *Transfer) WaitLayer(ctx context.Context, layer uint32) error {
	return t.detail(t.wait(ctx, "sg_transfer_wait_layer", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_wait_layer(t.h, layer, timeout, e)
	}))
}

// WaitLayerState waits until every bit of bits is set for the layer.
func (t *Transfer) WaitLayerState(ctx context.Context, layer uint32, bits LayerState) error {
	return t.detail(t.wait(ctx, "sg_transfer_wait_layer_state", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_wait_layer_state(t.h, layer, uint32(bits), timeout, e)
	}))
}

// LayerState is the layer's current readiness bits: one native call that allocates nothing,
// cheap enough to poll.
func (t *Transfer) LayerState(layer uint32) (LayerState, error) {
	const op = "sg_transfer_layer_state"
	if t.life.closed.Load() {
		return 0, closedError(op, "transfer")
	}
	if !t.c.enter() {
		return 0, closedError(op, "context")
	}
	e := getErrInfo()
	v := raw.Sgo_transfer_layer_state_value(t.h, layer, e.p)
	t.c.leave()
	if v < 0 {
		return 0, e.result(op, int32(v))
	}
	errInfos.Put(e)
	return LayerState(v), nil
}

// Fetch (decode, on-demand path) asks for logical blocks of a layer that are not resident; it
// returns at once (see WaitBlocks, EventBlocksReady).
func (t *Transfer) Fetch(layer uint32, blocks []uint32) error {
	return t.call("sg_transfer_fetch", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_fetch(t.h, layer, firstOrNil(blocks), uint64(len(blocks)), e)
	})
}

// WaitBlocks (decode) waits until the logical blocks of a layer are resident.
func (t *Transfer) WaitBlocks(ctx context.Context, layer uint32, blocks []uint32) error {
	return t.detail(t.wait(ctx, "sg_transfer_wait_blocks", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_wait_blocks(t.h, layer, firstOrNil(blocks), uint64(len(blocks)), timeout, e)
	}))
}

// Residency of one layer: bit i (LSB first in each byte) set when logical block i is in place
// (decode) or delivered (prefill); numBits is the number of blocks.
func (t *Transfer) Residency(layer uint32) (bitmap []byte, numBits uint64, err error) {
	err = t.call("sg_transfer_residency", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_residency(t.h, layer, nil, 0, &numBits, e)
	})
	if err != nil {
		return nil, 0, err
	}
	bitmap = make([]byte, (numBits+7)/8+1)
	err = t.call("sg_transfer_residency", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_residency(t.h, layer, &bitmap[0], uint64(len(bitmap)), &numBits, e)
	})
	return bitmap[:(numBits+7)/8], numBits, err
}

// Digests (decode, proactive path) are the layer's page digests as received (fp32).
func (t *Transfer) Digests(layer uint32) ([]float32, error) {
	var n uint64
	err := t.call("sg_transfer_digests", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_digests(t.h, layer, nil, 0, &n, e)
	})
	if err != nil || n == 0 {
		return nil, err
	}
	out := make([]float32, n)
	err = t.call("sg_transfer_digests", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_digests(t.h, layer, &out[0], n, &n, e)
	})
	return out[:n], err
}

// Status is the transfer's own state: StatusOK when complete, StatusInProgress, or its error,
// with the detail of an error that happened in the background (sg_transfer_status). err is the
// call's own failure (a closed transfer, say).
func (t *Transfer) Status() (status Status, detail string, err error) {
	var st int32
	buf := make([]byte, 512)
	err = t.call("sg_transfer_status", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_status(t.h, &st, &buf[0], uint64(len(buf)), e)
	})
	return Status(st), cString(buf), err
}

// detail adds the transfer's background detail to an error of the transfer that came without a
// message.
func (t *Transfer) detail(err error) error {
	e, ok := err.(*Error)
	if !ok || e.Message != "" || e.cause != nil || e.status == StatusInvalidHandle {
		return err
	}
	if st, msg, serr := t.Status(); serr == nil && st == e.status {
		e.Message = msg
	}
	return err
}

// TransferStats mirror sg_transfer_stats_t.
type TransferStats struct {
	Bytes, RMAOps, Segments, StagedBytes, StagingCopies, LayersReady uint64
	StartNs, EndNs                                                   uint64 // CLOCK_MONOTONIC
	BytesFull, BytesProactive, BytesOnDemand, BytesSpeculative       uint64
	DigestBytes, FetchRequests, FetchBlocks                          uint64
	QuantizedBytes, QuantizedWireBytes                               uint64 // WireQuant: pool bytes, their wire bytes
}

// Stats of the transfer.
func (t *Transfer) Stats() (TransferStats, error) {
	o := raw.Sgo_transfer_stats_new()
	if o.Swigcptr() == 0 {
		return TransferStats{}, newError("sg_transfer_stats", StatusNoMemory, "cannot allocate the stats")
	}
	defer raw.DeleteSg_transfer_stats_t(o)
	err := t.call("sg_transfer_stats", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_stats(t.h, o, e)
	})
	if err != nil {
		return TransferStats{}, err
	}
	return TransferStats{
		Bytes: o.GetBytes(), RMAOps: o.GetRma_ops(), Segments: o.GetSegments(), StagedBytes: o.GetStaged_bytes(),
		StagingCopies: o.GetStaging_copies(), LayersReady: o.GetLayers_ready(),
		StartNs: o.GetStart_ns(), EndNs: o.GetEnd_ns(),
		BytesFull: o.GetBytes_full(), BytesProactive: o.GetBytes_proactive(), BytesOnDemand: o.GetBytes_on_demand(),
		BytesSpeculative: o.GetBytes_speculative(), DigestBytes: o.GetDigest_bytes(),
		FetchRequests: o.GetFetch_requests(), FetchBlocks: o.GetFetch_blocks(),
		QuantizedBytes: o.GetQuantized_bytes(), QuantizedWireBytes: o.GetQuantized_wire_bytes(),
	}, nil
}

// LayerTime is how long the layer took to become ready; 0 while it is not.
func (t *Transfer) LayerTime(layer uint32) (time.Duration, error) {
	var ns uint64
	err := t.call("sg_transfer_layer_time", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_layer_time(t.h, layer, &ns, e)
	})
	return time.Duration(ns), err
}

// Cancel cancels the transfer here and at the peer; it returns at once (see WaitQuiesced).
func (t *Transfer) Cancel() error {
	return t.call("sg_transfer_cancel", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_cancel(t.h, e)
	})
}

// WaitQuiesced waits until the transfer has finished and nothing of it is in flight: its blocks
// may be reused.
func (t *Transfer) WaitQuiesced(ctx context.Context) error {
	return t.wait(ctx, "sg_transfer_wait_quiesced", func(timeout uint64, e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_wait_quiesced(t.h, timeout, e)
	})
}

// Release releases the transfer (sg_transfer_release): an incomplete one is canceled first, and
// it returns once the transfer is quiesced. Safe to call more than once.
func (t *Transfer) Release() error {
	if t == nil {
		return nil
	}
	err := t.life.close(t.c, "sg_transfer_release", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_transfer_release(t.h, e)
	})
	t.c.transfers.Delete(t.h)
	return err
}

// Close is Release, for io.Closer.
func (t *Transfer) Close() error {
	if t == nil {
		return nil
	}
	return t.Release()
}
