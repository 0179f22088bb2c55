package main

import (
	"bytes"
	"fmt"
)

// inv7 is 7^-1 mod 256. The byte at offset o of a plane is (base + 7 o) mod 256 with
// base = (l*131 + p*71 + i*29 + r*13) mod 256; with k = base * inv7 mod 256 that is
// 7 (o + k) mod 256 = ramp[o + k], so every plane is a slice of one precomputed ramp.
const inv7 = 183

func newRamp() []byte {
	ramp := make([]byte, planeBytes+256)
	for j := range ramp {
		ramp[j] = byte(j * 7)
	}
	return ramp
}

func (r *run) planePattern(layer, plane, block uint32, req int) []byte {
	base := (layer*131 + plane*71 + block*29 + uint32(req)*13) & 0xFF
	k := (base * inv7) & 0xFF
	return r.ramp[k : k+planeBytes]
}

// planeAt is logical block i's plane (0 = K, 1 = V) of a layer in this side's pool.
func (r *run) planeAt(layer, plane, i uint32) []byte {
	region := r.pool.K(int(layer))
	if plane == 1 {
		region = r.pool.V(int(layer))
	}
	off := int(r.table[i]) * planeBytes
	return region[off : off+planeBytes]
}

// requestBytes is the payload of one request: every plane of every logical block of every layer.
func (r *run) requestBytes() uint64 {
	return uint64(r.cfg.layers) * planes * uint64(r.n) * planeBytes
}

func (r *run) fillRequest(req int) {
	for l := uint32(0); l < r.cfg.layers; l++ {
		for p := uint32(0); p < planes; p++ {
			for i := uint32(0); i < r.n; i++ {
				copy(r.planeAt(l, p, i), r.planePattern(l, p, i, req))
			}
		}
	}
}

func (r *run) clearRequest() {
	for l := uint32(0); l < r.cfg.layers; l++ {
		for p := uint32(0); p < planes; p++ {
			for i := uint32(0); i < r.n; i++ {
				plane := r.planeAt(l, p, i)
				for o := range plane {
					plane[o] = 0
				}
			}
		}
	}
}

// verifyRequest checks every byte of every logical block; the first difference is the reason.
func (r *run) verifyRequest(req int) error {
	for l := uint32(0); l < r.cfg.layers; l++ {
		for p := uint32(0); p < planes; p++ {
			for i := uint32(0); i < r.n; i++ {
				got, want := r.planeAt(l, p, i), r.planePattern(l, p, i, req)
				if bytes.Equal(got, want) {
					continue
				}
				o := 0
				for got[o] == want[o] {
					o++
				}
				return fail("MISMATCH", "%s: layer %d %s logical block %d (physical %d) offset %d: got 0x%02x, want 0x%02x",
					requestIDs[req], l, [2]string{"K", "V"}[p], i, r.table[i], o, got[o], want[o])
			}
		}
	}
	r.bytes += r.requestBytes()
	return nil
}

func (r *run) progress(format string, args ...any) {
	fmt.Fprintf(stderr, "[go %s] %s\n", r.cfg.role, fmt.Sprintf(format, args...))
}
