// Package raw is the layer SWIG generates from bindings/swig/smartgen.i (smartgen.go and
// smartgen_wrap.c, made by ../../generate.sh; do not edit them). It is internal: package smartgen
// is the API, and only it calls these functions. Calls that can fail take an Sg_error_info_t the
// native side fills in the same call (the Sgo_* shims of go.i for the functions without one).
package raw

// The header and the library come from pkg-config: the libsmartgen-dev package's smartgen.pc, or a
// build tree's smartgen-uninstalled.pc with PKG_CONFIG_PATH=build/release (bindings/go/README.md).
// CGO_CFLAGS / CGO_LDFLAGS still add to them.

// #cgo pkg-config: smartgen
import "C"
