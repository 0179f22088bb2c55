package smartgen

import (
	"sync"
	"syscall"
	"unsafe"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// DType of the KV elements (sg_dtype_t).
type DType uint32

const (
	FP32    DType = 0
	FP16    DType = 1
	BF16    DType = 2
	FP8E4M3 DType = 3
)

// Packing says where K and V of one block live (sg_kv_packing_t).
type Packing uint32

const (
	Separate Packing = 0 // K and V in their own region per layer, same block ids
	Fused    Packing = 1 // one region per layer; a block holds its K plane, then its V plane
)

// BlockOrder of the elements inside one K (or V) plane (sg_block_order_t).
type BlockOrder uint32

const (
	TokenMajor BlockOrder = 0 // [token][kv_head][head_dim]
	HeadMajor  BlockOrder = 1 // [kv_head][token][head_dim]
)

// Layout describes a paged KV pool in host memory (sg_kv_layout_t without the base pointers,
// which the Pool provides). As in C, every field means the value written, 0 included: the zero
// DType is FP32, and a zero count is invalid.
type Layout struct {
	NumLayers        uint32
	NumKVHeads       uint32
	HeadDim          uint32
	TokensPerBlock   uint32
	NumBlocks        uint64 // blocks per layer
	DType            DType
	Packing          Packing
	BlockOrder       BlockOrder
	BlockStrideBytes uint64 // 0 = packed
}

// MemKind says where a pool's memory is (sg_mem_kind_t).
type MemKind uint32

const (
	MemHost MemKind = 0 // host memory
	MemCUDA MemKind = 1 // device memory of CUDA device Memory.Device (needs the CUDA plugin)
)

// Memory is the memory of a pool the host owns, as a serving engine owns its KV cache: per layer,
// the address of the K region (the fused K+V region with Fused packing) and of the V region
// (Separate only), each Pool.RegionBytes long with the layout's block stride. The addresses are
// the host's: memory from C, mmap, a CUDA allocator or a tensor library, never Go heap memory
// (cgo's pointer rules forbid handing that to C to keep). The pool never frees it.
type Memory struct {
	Kind   MemKind
	Device int32            // CUDA device ordinal for MemCUDA
	K      []unsafe.Pointer // NumLayers addresses
	V      []unsafe.Pointer // NumLayers addresses for Separate; nil for Fused
}

// toC makes a C sg_kv_layout_t of l; the caller deletes it.
func (l Layout) toC() raw.Sg_kv_layout_t {
	o := raw.NewSg_kv_layout_t()
	raw.Sg_kv_layout_init(o)
	o.SetNum_layers(l.NumLayers)
	o.SetNum_kv_heads(l.NumKVHeads)
	o.SetHead_dim(l.HeadDim)
	o.SetTokens_per_block(l.TokensPerBlock)
	o.SetNum_blocks(l.NumBlocks)
	o.SetDtype(uint32(l.DType))
	o.SetPacking(uint32(l.Packing))
	o.SetBlock_order(uint32(l.BlockOrder))
	o.SetMem_kind(0) // SG_MEM_HOST
	o.SetBlock_stride_bytes(l.BlockStrideBytes)
	return o
}

// PlaneBytes is the size of one K (or V) plane of one block (sg_kv_layout_plane_bytes).
func (l Layout) PlaneBytes() (uint64, error) {
	o := l.toC()
	defer raw.DeleteSg_kv_layout_t(o)
	var n uint64
	e := getErrInfo()
	err := e.result("sg_kv_layout_plane_bytes", raw.Sgo_sg_kv_layout_plane_bytes(o, &n, e.p))
	return n, err
}

// Pool is the memory of a paged KV pool, owned by this package so that it obeys cgo's pointer
// rules: each layer's K region (and V region, for Separate) is an anonymous mmap, outside the Go
// heap, which Go code reads and writes as a []byte and the library addresses directly. The
// per-layer base pointers live in C memory. Close unmaps it; the slices K and V returned must not
// be used after that.
type Pool struct {
	layout      Layout
	mem         MemKind
	device      int32
	hostOwned   bool // NewPoolFromMemory: the memory is the host's, never unmapped here
	regionBytes uint64
	k, v        [][]byte
	kBases      *uintptr // C arrays of NumLayers pointers (void *const *)
	vBases      *uintptr

	mu     sync.Mutex
	closed bool
	kvs    map[*KV]struct{} // registrations that use the pool
}

// NewPool checks the layout and maps its memory, zeroed.
func NewPool(layout Layout) (*Pool, error) {
	p := &Pool{layout: layout, kvs: map[*KV]struct{}{}}
	ok := false
	defer func() {
		if !ok {
			p.release()
		}
	}()
	n := uint64(layout.NumLayers)
	p.kBases = raw.Sgo_pointers_new(n)
	if layout.Packing == Separate {
		p.vBases = raw.Sgo_pointers_new(n)
	}
	if p.kBases == nil || (layout.Packing == Separate && p.vBases == nil) {
		return nil, newError("NewPool", StatusNoMemory, "cannot allocate the base pointer arrays")
	}
	// The library checks a whole layout, base pointers included, before it says a region's size,
	// and only tests them for NULL: until the regions are mapped, the arrays point at themselves.
	placeholder := uintptr(unsafe.Pointer(p.kBases))
	for l := uint64(0); l < n; l++ {
		raw.Sgo_pointers_set(p.kBases, l, placeholder)
		if p.vBases != nil {
			raw.Sgo_pointers_set(p.vBases, l, placeholder)
		}
	}
	o := p.cLayout()
	defer raw.DeleteSg_kv_layout_t(o)
	e := getErrInfo()
	if err := e.result("sg_kv_layout_validate", raw.Sg_kv_layout_validate(o, e.p)); err != nil {
		return nil, err
	}
	var region uint64
	e = getErrInfo()
	if err := e.result("sg_kv_layout_region_bytes", raw.Sgo_sg_kv_layout_region_bytes(o, &region, e.p)); err != nil {
		return nil, err
	}
	p.regionBytes = region
	if uint64(int(p.regionBytes)) != p.regionBytes {
		return nil, newError("NewPool", StatusOutOfRange, "a layer's region does not fit in memory")
	}
	for l := uint64(0); l < n; l++ {
		k, err := mapRegion(p.regionBytes)
		if err != nil {
			return nil, err
		}
		p.k = append(p.k, k)
		raw.Sgo_pointers_set(p.kBases, l, uintptr(unsafe.Pointer(&k[0])))
		if p.vBases != nil {
			v, err := mapRegion(p.regionBytes)
			if err != nil {
				return nil, err
			}
			p.v = append(p.v, v)
			raw.Sgo_pointers_set(p.vBases, l, uintptr(unsafe.Pointer(&v[0])))
		}
	}
	ok = true
	return p, nil
}

// NewPoolFromMemory makes a pool of memory the host already has (an engine's KV cache), with the
// full layout: fused or separate K/V, a padded block stride, host or CUDA device memory. The
// library registers those addresses as they are; nothing is copied or allocated. The host keeps
// the memory valid until the pool is closed (after its KV), and Close never frees it. For host
// memory K and V return views of it; for device memory they return nil.
func NewPoolFromMemory(layout Layout, mem Memory) (*Pool, error) {
	n := uint64(layout.NumLayers)
	if uint64(len(mem.K)) != n {
		return nil, newError("NewPoolFromMemory", StatusInvalidArgument, "Memory.K must hold NumLayers addresses")
	}
	if layout.Packing == Separate && uint64(len(mem.V)) != n {
		return nil, newError("NewPoolFromMemory", StatusInvalidArgument, "Memory.V must hold NumLayers addresses (Separate packing)")
	}
	if layout.Packing == Fused && len(mem.V) != 0 {
		return nil, newError("NewPoolFromMemory", StatusInvalidArgument, "Memory.V must be nil with Fused packing")
	}
	for l := uint64(0); l < n; l++ {
		if mem.K[l] == nil || (layout.Packing == Separate && mem.V[l] == nil) {
			return nil, newError("NewPoolFromMemory", StatusInvalidArgument, "a layer's address is 0")
		}
	}
	p := &Pool{layout: layout, mem: mem.Kind, device: mem.Device, hostOwned: true, kvs: map[*KV]struct{}{}}
	ok := false
	defer func() {
		if !ok {
			p.release()
		}
	}()
	p.kBases = raw.Sgo_pointers_new(n)
	if layout.Packing == Separate {
		p.vBases = raw.Sgo_pointers_new(n)
	}
	if p.kBases == nil || (layout.Packing == Separate && p.vBases == nil) {
		return nil, newError("NewPoolFromMemory", StatusNoMemory, "cannot allocate the base pointer arrays")
	}
	for l := uint64(0); l < n; l++ {
		raw.Sgo_pointers_set(p.kBases, l, uintptr(mem.K[l]))
		if p.vBases != nil {
			raw.Sgo_pointers_set(p.vBases, l, uintptr(mem.V[l]))
		}
	}
	o := p.cLayout()
	defer raw.DeleteSg_kv_layout_t(o)
	e := getErrInfo()
	if err := e.result("sg_kv_layout_validate", raw.Sg_kv_layout_validate(o, e.p)); err != nil {
		return nil, err
	}
	var region uint64 // a local: cgo checks the whole object an out-parameter points into
	e = getErrInfo()
	if err := e.result("sg_kv_layout_region_bytes", raw.Sgo_sg_kv_layout_region_bytes(o, &region, e.p)); err != nil {
		return nil, err
	}
	p.regionBytes = region
	if mem.Kind == MemHost && uint64(int(p.regionBytes)) == p.regionBytes {
		for l := uint64(0); l < n; l++ {
			p.k = append(p.k, unsafe.Slice((*byte)(mem.K[l]), int(p.regionBytes)))
			if p.vBases != nil {
				p.v = append(p.v, unsafe.Slice((*byte)(mem.V[l]), int(p.regionBytes)))
			}
		}
	}
	ok = true
	return p, nil
}

func mapRegion(bytes uint64) ([]byte, error) {
	b, err := syscall.Mmap(-1, 0, int(bytes), syscall.PROT_READ|syscall.PROT_WRITE,
		syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, newError("mmap", StatusNoMemory, err.Error())
	}
	return b, nil
}

// cLayout is the pool's C layout with its base pointers; the caller deletes it.
func (p *Pool) cLayout() raw.Sg_kv_layout_t {
	o := p.layout.toC()
	o.SetMem_kind(uint32(p.mem))
	o.SetDevice(p.device)
	raw.Sgo_kv_layout_set_bases(o, p.kBases, p.vBases, uint64(p.layout.NumLayers))
	return o
}

// Layout the pool was made with.
func (p *Pool) Layout() Layout { return p.layout }

// RegionBytes is the size of one layer's K (or V, or fused) region.
func (p *Pool) RegionBytes() uint64 { return p.regionBytes }

// K is layer l's K region (the fused region with Fused packing); nil for device memory.
func (p *Pool) K(l int) []byte {
	if p.k == nil {
		return nil
	}
	return p.k[l]
}

// V is layer l's V region; nil with Fused packing or device memory.
func (p *Pool) V(l int) []byte {
	if p.v == nil {
		return nil
	}
	return p.v[l]
}

// Close unmaps the pool. It fails with StatusInvalidState while a registration of it is open
// (close the KV first, or its context). Safe to call more than once.
func (p *Pool) Close() error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	for kv := range p.kvs {
		if kv.open() {
			return newError("Pool.Close", StatusInvalidState, "the pool is still registered (close its KV first)")
		}
	}
	p.closed = true
	p.release()
	return nil
}

func (p *Pool) release() {
	if !p.hostOwned {
		for _, b := range p.k {
			_ = syscall.Munmap(b)
		}
		for _, b := range p.v {
			_ = syscall.Munmap(b)
		}
	}
	p.k, p.v = nil, nil
	if p.kBases != nil {
		raw.Sgo_pointers_free(p.kBases)
		p.kBases = nil
	}
	if p.vBases != nil {
		raw.Sgo_pointers_free(p.vBases)
		p.vBases = nil
	}
}
