package smartgen

import (
	"errors"
	"testing"
)

// Nil arguments are refused with a typed error and nil receivers close as no-ops: 0.4 panicked
// (a nil dereference) on Export(nil), Register(nil), Expect(id, nil, ...) and (*Session)(nil).Close().
func TestNilArgumentsAreTypedErrorsAndNilClosesAreNoOps(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{})
	wantInvalid := func(what string, err error) {
		t.Helper()
		var e *Error
		if !errors.As(err, &e) || e.Status() != StatusInvalidArgument {
			t.Errorf("%s: got %v, want a *Error with StatusInvalidArgument", what, err)
		}
	}
	wantInvalid("Export(nil)", p.decodeSess.Export(nil))
	_, err := p.prefill.Register(nil)
	wantInvalid("Register(nil)", err)
	_, err = p.decodeSess.Expect("r", nil, []uint32{0}, 16, TransferOptions{})
	wantInvalid("Expect(id, nil, ...)", err)
	_, err = p.prefillSession.Post("r", nil, []uint32{0}, 16, TransferOptions{})
	wantInvalid("Post(id, nil, ...)", err)
	var nilSession *Session
	_, err = nilSession.Expect("r", p.decodeKV, []uint32{0}, 16, TransferOptions{})
	wantInvalid("(*Session)(nil).Expect", err)
	for name, closer := range map[string]interface{ Close() error }{
		"Session": (*Session)(nil), "Transfer": (*Transfer)(nil), "KV": (*KV)(nil), "Pool": (*Pool)(nil),
		"Context": (*Context)(nil), "Listener": (*Listener)(nil), "Profile": (*Profile)(nil),
	} {
		if err := closer.Close(); err != nil {
			t.Errorf("(*%s)(nil).Close() = %v, want nil", name, err)
		}
	}
	if err := (*Transfer)(nil).Release(); err != nil {
		t.Errorf("(*Transfer)(nil).Release() = %v", err)
	}
}
