// Package raw is the layer SWIG generates from bindings/swig/smartgen.i (smartgen.go and
// smartgen_wrap.c, made by ../../generate.sh; do not edit them). It is internal: package smartgen
// is the API, and only it calls these functions. Calls that can fail take an Sg_error_info_t the
// native side fills in the same call (the Sgo_* shims of go.i for the functions without one).
package raw

// The header directory and the library's directory come from CGO_CFLAGS / CGO_LDFLAGS (see
// bindings/go/README.md); only the library's name is fixed here.

// #cgo LDFLAGS: -lsmartgen
import "C"
