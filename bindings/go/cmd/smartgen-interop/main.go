// Command smartgen-interop is the Go interop program: one side (prefill or decode) of the transfer
// that tests/interop runs between every pair of languages. What the sides agree on (command line,
// pool shape, block tables, bytes, the order of the transfers, the notifications, the output
// line) is docs/bindings.md, "The interop program"; examples/interop/interop.c is the reference
// this follows step by step.
//
// Only package smartgen is used; the key comes from SG_AUTH_KEY_FILE (read by the library).
// Output: one line on stdout; progress goes to stderr.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	smartgen "github.com/smartgen/smartgen/bindings/go"
)

// The shape every language uses (docs/bindings.md).
const (
	kvHeads     = 8
	headDim     = 128
	blockTokens = 16
	planeBytes  = blockTokens * kvHeads * headDim * 2 // fp16: 32,768 bytes per K or V plane
	planes      = 2                                   // K and V

	// Logical block i lives at physical block (i*stride + offset) % blocks, differently per side,
	// so the runtime has to map one scattered table onto another.
	prefillStride, prefillOffset = 37, 11
	decodeStride, decodeOffset   = 29, 5

	reqFull, reqSelective = 0, 1
	readyPrefix           = "ready "

	connectRetry = 50 * time.Millisecond // between connects refused while the peer starts
)

var requestIDs = [2]string{"interop-full", "interop-selective"}

const profileFormat = `{"version":1,"model":"interop","num_layers":%d,"num_kv_heads":8,"block_tokens":16,` +
	`"defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}`

type config struct {
	role      string
	prefill   bool
	listen    bool
	addr      string
	port      uint16
	layers    uint32
	tokens    uint32
	blocks    uint32
	selective bool
	calls     uint64
	timeout   time.Duration
	timeoutS  uint32
}

// failure is the first error of a run, reported as `reason="<status name>: <detail>"`.
type failure struct {
	name, detail string
}

func (f *failure) Error() string { return f.name + ": " + f.detail }

func fail(name, format string, args ...any) error {
	return &failure{name: name, detail: fmt.Sprintf(format, args...)}
}

// reason gives a binding error as "<status name>: <call>: <message>", as the C program does.
func reason(err error) string {
	var f *failure
	if errors.As(err, &f) {
		return f.Error()
	}
	var e *smartgen.Error
	if errors.As(err, &e) {
		msg := e.Message
		if msg == "" {
			msg = "(no detail)"
		}
		return e.Status().String() + ": " + e.Op + ": " + msg
	}
	return "SG_ERR_INTERNAL: " + err.Error()
}

func parseArgs(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("smartgen-interop", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: %s --role prefill|decode (--listen ADDR:PORT | --peer ADDR:PORT)\n"+
			"          [--layers N] [--tokens N] [--blocks N] [--no-selective] [--calls N] [--timeout-s N]\n"+
			"  One side of the SmartGen interop transfer (docs/bindings.md). The session key comes from\n"+
			"  the file named by SG_AUTH_KEY_FILE. Prints one result line on stdout; exit status 0 on\n"+
			"  success, 1 otherwise.\n", fs.Name())
	}
	role := fs.String("role", "", "prefill or decode")
	listen := fs.String("listen", "", "ADDR:PORT to listen on")
	peer := fs.String("peer", "", "ADDR:PORT to connect to")
	layers := fs.Uint64("layers", 8, "layers")
	tokens := fs.Uint64("tokens", 1024, "tokens of the request, a multiple of 16")
	blocks := fs.Uint64("blocks", 80, "blocks per layer in the pool")
	noSelective := fs.Bool("no-selective", false, "skip the selective transfer")
	fs.Uint64Var(&c.calls, "calls", 0, "decode: sg_transfer_layer_state calls to time")
	timeoutS := fs.Uint64("timeout-s", 60, "bound on every wait, seconds")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "%v", err)
	}
	if fs.NArg() > 0 {
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "unknown argument %s", fs.Arg(0))
	}
	switch *role {
	case "prefill", "decode":
		c.role, c.prefill = *role, *role == "prefill"
	default:
		fs.Usage()
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "--role must be prefill or decode, not '%s'", *role)
	}
	if (*listen == "") == (*peer == "") {
		fs.Usage()
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "give one of --listen and --peer, once")
	}
	endpoint, name := *listen, "--listen"
	c.listen = endpoint != ""
	if !c.listen {
		endpoint, name = *peer, "--peer"
	}
	host, port, err := net.SplitHostPort(endpoint)
	p, perr := strconv.ParseUint(port, 10, 16)
	if err != nil || perr != nil || host == "" {
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "%s '%s' is not ADDR:PORT", name, endpoint)
	}
	c.addr, c.port = host, uint16(p)
	if !c.listen && c.port == 0 {
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "--peer needs a port other than 0")
	}
	for _, v := range []struct {
		name string
		val  uint64
		dst  *uint32
	}{{"--layers", *layers, &c.layers}, {"--tokens", *tokens, &c.tokens}, {"--blocks", *blocks, &c.blocks},
		{"--timeout-s", *timeoutS, &c.timeoutS}} {
		if v.val == 0 || v.val > math.MaxUint32 {
			return nil, fail("SG_ERR_INVALID_ARGUMENT", "%s %d is not a number from 1 to %d", v.name, v.val,
				uint32(math.MaxUint32))
		}
		*v.dst = uint32(v.val)
	}
	c.selective = !*noSelective
	c.timeout = time.Duration(c.timeoutS) * time.Second
	if c.tokens%blockTokens != 0 {
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "--tokens %d is not a multiple of %d", c.tokens, blockTokens)
	}
	n := c.tokens / blockTokens
	// Coprime strides make both tables permutations, so no block is named twice.
	if c.blocks < n || gcd(c.blocks, prefillStride) != 1 || gcd(c.blocks, decodeStride) != 1 {
		return nil, fail("SG_ERR_INVALID_ARGUMENT",
			"--blocks %d must be at least %d (the request's blocks) and coprime to %d and %d",
			c.blocks, n, prefillStride, decodeStride)
	}
	// The on-demand fetch names logical blocks 1, n/2 and n-2.
	if c.selective && n < 2 {
		return nil, fail("SG_ERR_INVALID_ARGUMENT", "the selective transfer needs at least 32 tokens")
	}
	return c, nil
}

func gcd(a, b uint32) uint32 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func main() {
	r := &run{}
	cfg, err := parseArgs(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	role := "unknown"
	if err == nil {
		r.cfg = cfg
		role = cfg.role
		err = r.execute()
	} else if cfg == nil {
		for i, a := range os.Args {
			if (a == "--role" || a == "-role") && i+1 < len(os.Args) &&
				(os.Args[i+1] == "prefill" || os.Args[i+1] == "decode") {
				role = os.Args[i+1]
			}
		}
	}
	if err != nil {
		text := strings.NewReplacer(`"`, `'`, "\n", " ", "\r", " ").Replace(reason(err))
		fmt.Printf("interop lang=go role=%s result=FAILED reason=\"%s\"\n", role, text)
		os.Exit(1)
	}
	gbps := 0.0
	if r.fullS > 0 {
		gbps = float64(r.requestBytes()) / r.fullS / 1e9
	}
	selective := "skipped"
	if cfg.selective {
		selective = "ok"
	}
	fmt.Printf("interop lang=go role=%s result=ok full=ok selective=%s bytes=%d full_s=%.6f full_gbps=%.3f calls_ns=%.1f\n",
		role, selective, r.bytes, r.fullS, gbps, r.callsNs)
}
