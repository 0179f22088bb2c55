package smartgen

import (
	"sync"
	"sync/atomic"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// Profile is a selection profile (sg_profile_t): per layer and KV head, a policy and a budget,
// parsed from JSON (docs/profiles.md). Immutable and safe to share; a transfer copies it when it
// is posted, so a profile may be closed while transfers made with it run.
type Profile struct {
	h      uintptr
	mu     sync.RWMutex // shared by calls, exclusive for Close (sg_profile_destroy)
	closed atomic.Bool
}

// ParseProfile parses a profile from JSON text (sg_profile_parse).
func ParseProfile(json string) (*Profile, error) {
	var h uintptr
	e := getErrInfo()
	if err := e.result("sg_profile_parse", raw.Sg_profile_parse(json, uint64(len(json)), &h, e.p)); err != nil {
		return nil, err
	}
	return &Profile{h: h}, nil
}

// LoadProfile reads and parses a profile file (sg_profile_load).
func LoadProfile(path string) (*Profile, error) {
	var h uintptr
	e := getErrInfo()
	if err := e.result("sg_profile_load", raw.Sg_profile_load(path, &h, e.p)); err != nil {
		return nil, err
	}
	return &Profile{h: h}, nil
}

// JSON is the profile in its canonical JSON form (sg_profile_to_json).
func (p *Profile) JSON() (string, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed.Load() {
		return "", closedError("sg_profile_to_json", "profile")
	}
	var n uint64
	e := getErrInfo()
	if err := e.result("sg_profile_to_json", raw.Sgo_sg_profile_to_json(p.h, nil, 0, &n, e.p)); err != nil {
		return "", err
	}
	buf := make([]byte, n+1)
	e = getErrInfo()
	if err := e.result("sg_profile_to_json", raw.Sgo_sg_profile_to_json(p.h, &buf[0], uint64(len(buf)), &n, e.p)); err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// lock holds the profile open for a call that uses its handle; 0 for a nil profile. ok is false
// when it is closed. unlock must follow either way.
func (p *Profile) lock() (h uintptr, ok bool) {
	if p == nil {
		return 0, true
	}
	p.mu.RLock()
	return p.h, !p.closed.Load()
}

func (p *Profile) unlock() {
	if p != nil {
		p.mu.RUnlock()
	}
}

// Close destroys the profile. Safe to call more than once.
func (p *Profile) Close() error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Swap(true) {
		return nil
	}
	e := getErrInfo()
	return e.result("sg_profile_destroy", raw.Sgo_sg_profile_destroy(p.h, e.p))
}
