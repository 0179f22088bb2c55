// Package smartgen is the Go binding of SmartGen, the KV-cache transfer runtime for
// disaggregated LLM serving (libsmartgen.so.0, include/smartgen/smartgen.h).
//
// A Context is one engine process's runtime. A Pool is paged KV memory that Go code fills and the
// library addresses directly; Context.Register makes it a KV. A Session links two contexts (one
// Listens and Accepts, the other Connects); both Export their KV to it. The decode side Expects a
// request's KV into its blocks, the prefill side Posts it from its own, and the runtime moves the
// blocks, layer by layer, over the paths of TransferOptions. Waits take a context.Context;
// failures are *Error values carrying a Status and the library's message; events arrive on
// Context.Events. Every object has Close, safe to call twice.
//
// The C calls go through internal/raw, the layer SWIG generates from bindings/swig/smartgen.i.
package smartgen
