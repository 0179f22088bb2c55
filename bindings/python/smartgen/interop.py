"""The interop program in Python (docs/bindings.md, "The interop program"): either side of the two
agreed transfers, every byte checked, so a Python engine pairs with the C, Go, Java and Rust ones.

    python3 -m smartgen.interop --role prefill|decode (--listen ADDR:PORT | --peer ADDR:PORT)
        [--layers N] [--tokens N] [--blocks N] [--no-selective] [--calls N] [--timeout-s N]

The pool is engine memory: one NumPy array per layer and plane, registered as it is.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import smartgen

KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 128, 16
PLANE_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2  # fp16: 32,768 bytes
REQUEST_IDS = ("interop-full", "interop-selective")
READY = "ready "
PROFILE = ('{"version":1,"model":"interop","num_layers":%d,"num_kv_heads":8,"block_tokens":16,'
           '"defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}')


class Failure(Exception):
    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")


def progress(msg: str) -> None:
    print(f"interop-python: {msg}", file=sys.stderr, flush=True)


class Run:
    def __init__(self, args):
        self.args = args
        self.prefill = args.role == "prefill"
        self.n = args.tokens // BLOCK_TOKENS
        stride, offset = (37, 11) if self.prefill else (29, 5)
        self.table = np.array([(i * stride + offset) % args.blocks for i in range(self.n)], dtype=np.uint32)
        shape = (args.blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
        # Each layer's K region and V region its own allocation, as the engine would have them.
        self.k = [np.zeros(shape, np.float16) for _ in range(args.layers)]
        self.v = [np.zeros(shape, np.float16) for _ in range(args.layers)]
        self.ramp = (np.arange(PLANE_BYTES, dtype=np.uint32) * 7) % 256
        self.bytes = 0
        self.full_s = 0.0
        self.calls_ns = 0.0
        self.xfer = [None, None]

    def expected(self, req: int, layer: int, plane: int, block: int) -> np.ndarray:
        base = (layer * 131 + plane * 71 + block * 29 + req * 13) % 256
        return ((self.ramp + base) % 256).astype(np.uint8)

    def planes(self, layer: int):
        return (self.k[layer].view(np.uint8).reshape(self.args.blocks, PLANE_BYTES),
                self.v[layer].view(np.uint8).reshape(self.args.blocks, PLANE_BYTES))

    def fill(self, req: int) -> None:
        for l in range(self.args.layers):
            for p, plane in enumerate(self.planes(l)):
                for i, phys in enumerate(self.table):
                    plane[phys] = self.expected(req, l, p, i)

    def clear(self) -> None:
        for l in range(self.args.layers):
            for plane in self.planes(l):
                plane[self.table] = 0

    def verify(self, req: int) -> None:
        for l in range(self.args.layers):
            for p, plane in enumerate(self.planes(l)):
                for i, phys in enumerate(self.table):
                    got, want = plane[phys], self.expected(req, l, p, i)
                    if not np.array_equal(got, want):
                        o = int(np.argmax(got != want))
                        raise Failure("MISMATCH", f"{REQUEST_IDS[req]}: layer {l} plane {p} block {i} byte {o}: "
                                                  f"got {int(got[o])}, want {int(want[o])}")
        self.bytes += self.request_bytes()

    def request_bytes(self) -> int:
        return self.args.layers * 2 * self.n * PLANE_BYTES

    def open_session(self, ctx) -> None:
        a = self.args
        if a.listen:
            with ctx.listen(a.addr, a.port) as lis:
                progress(f"listening on {a.addr}:{lis.port}")
                self.session = lis.accept(a.timeout_s)
        else:
            end = time.monotonic() + a.timeout_s
            while True:  # the listener may not be up yet: a refused connect is retried
                try:
                    self.session = ctx.connect(a.addr, a.port, timeout=max(0.1, end - time.monotonic()))
                    break
                except smartgen.Error as e:
                    if e.status != smartgen.SG_ERR_CONNECT or time.monotonic() + 0.05 > end:
                        raise
                    time.sleep(0.05)
        self.session.export(self.pool)
        progress(f"session with {a.addr}:{a.port}")

    # ---- prefill ----
    def await_ready(self, req: int) -> None:
        want = READY + REQUEST_IDS[req]
        end = time.monotonic() + self.args.timeout_s
        while True:
            got = self.session.next_notification()
            if got is not None:
                got = got[:-1] if got.endswith(b"\0") else got
                if got.decode(errors="replace") != want:
                    raise Failure("SG_ERR_PROTOCOL", f"expected the notification '{want}', got '{got[:200]!r}'")
                return
            if time.monotonic() > end:
                raise Failure("SG_ERR_TIMEOUT", f"no '{want}' notification within --timeout-s {self.args.timeout_s}")
            time.sleep(0.0005)

    def post(self, req: int, profile=None) -> None:
        self.await_ready(req)
        start = time.monotonic()
        paths = smartgen.PATH_FULL if req == 0 else smartgen.PATHS_SELECTIVE
        x = self.session.post(REQUEST_IDS[req], self.pool, self.table, self.args.tokens, paths=paths,
                              all_layers_written=True, profile=profile)
        self.xfer[req] = x
        x.wait(self.args.timeout_s)  # complete once the decode side confirmed every byte
        if req == 0:
            self.full_s = time.monotonic() - start
        self.bytes += self.request_bytes()
        progress(f"{REQUEST_IDS[req]} delivered and confirmed")
        self.xfer[req] = None
        x.release()

    def run_prefill(self) -> None:
        self.post(0)
        if self.args.selective:
            self.fill(1)
            with smartgen.Profile(PROFILE % self.args.layers) as profile:
                self.post(1, profile)

    # ---- decode ----
    def expect(self, req: int):
        self.clear()
        start = time.monotonic()
        x = self.session.expect(REQUEST_IDS[req], self.pool, self.table, self.args.tokens)
        self.xfer[req] = x
        self.session.notify(READY + REQUEST_IDS[req])
        return x, start

    def run_decode(self) -> None:
        t = self.args.timeout_s
        x, start = self.expect(0)
        x.wait(t)
        self.full_s = time.monotonic() - start
        self.verify(0)
        progress(f"{REQUEST_IDS[0]}: every byte checked ({self.full_s:.3f} s)")
        if self.args.selective:
            y, start = self.expect(1)
            for l in range(self.args.layers):
                y.wait_layer_state(l, smartgen.LAYER_ESSENTIAL, t)
            fetch = [1, self.n // 2, self.n - 2]
            y.fetch(0, fetch)
            y.wait_blocks(0, fetch, t)
            y.wait(t)  # the speculative path brings the rest
            self.verify(1)
            s = y.stats()
            progress(f"{REQUEST_IDS[1]}: every byte checked ({time.monotonic() - start:.3f} s); bytes proactive "
                     f"{s['bytes_proactive']}, on demand {s['bytes_on_demand']}, speculative {s['bytes_speculative']}; "
                     f"{s['fetch_requests']} fetch requests")
            self.xfer[1] = None
            y.release()
        if self.args.calls:
            layer_state = x.layer_state
            state = 0
            begin = time.perf_counter_ns()
            for _ in range(self.args.calls):
                state = layer_state(0)
            self.calls_ns = (time.perf_counter_ns() - begin) / self.args.calls
            if not state & smartgen.LAYER_READY:
                raise Failure("SG_ERR_INVALID_STATE", f"layer 0 of a completed transfer reads state {state:#x}")
            progress(f"{self.args.calls} calls of layer_state (sg_transfer_layer_state): {self.calls_ns:.1f} ns each")
        self.xfer[0] = None
        x.release()

    def execute(self) -> None:
        if self.prefill:
            self.fill(0)  # before the session: the decode side's full_s counts the transfer only
        # Provider tcp;ofi_rxm on 127.0.0.1, the key from SG_AUTH_KEY_FILE (read by the library).
        with smartgen.Context("tcp") as ctx:
            self.pool = ctx.register_pool(self.k, self.v)
            self.open_session(ctx)
            try:
                self.run_prefill() if self.prefill else self.run_decode()
                self.session.close(timeout=self.args.timeout_s)  # graceful: the peer read everything
            finally:
                for x in self.xfer:
                    if x is not None:
                        x.release()
                self.session.destroy()
                self.pool.close()


def parse(argv):
    p = argparse.ArgumentParser(prog="smartgen-interop-python", add_help=True)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--listen")
    g.add_argument("--peer")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--no-selective", action="store_true")
    p.add_argument("--calls", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=60)
    a = p.parse_args(argv)
    where = a.listen or a.peer
    addr, _, port = where.rpartition(":")
    if not addr or not port.isdigit() or int(port) > 65535:
        raise Failure("SG_ERR_INVALID_ARGUMENT", f"'{where}' is not ADDR:PORT")
    a.addr, a.port = addr, int(port)
    a.selective = not a.no_selective
    n = a.tokens // BLOCK_TOKENS
    if a.layers < 1 or a.tokens < 16 * 3 or a.tokens % 16 or a.blocks < n or a.blocks % 37 == 0 or a.blocks % 29 == 0:
        raise Failure("SG_ERR_INVALID_ARGUMENT", "--tokens must be a multiple of 16 (at least 48), --blocks at least "
                                                 "tokens/16 and coprime to 37 and 29, --layers at least 1")
    return a


def main(argv=None) -> int:
    role = "?"
    try:
        try:
            args = parse(argv if argv is not None else sys.argv[1:])
        except SystemExit as e:
            if e.code in (0, None):
                return 0
            raise Failure("SG_ERR_INVALID_ARGUMENT", "bad command line (see above)") from None
        role = args.role
        r = Run(args)
        r.execute()
    except smartgen.Error as e:
        print(f'interop lang=python role={role} result=FAILED reason="{e.name}: {e.message}"')
        return 1
    except Failure as e:
        print(f'interop lang=python role={role} result=FAILED reason="{e}"')
        return 1
    gbps = (r.request_bytes() / r.full_s / 1e9) if r.full_s > 0 else 0.0
    print(f"interop lang=python role={role} result=ok full=ok selective={'ok' if args.selective else 'skipped'} "
          f"bytes={r.bytes} full_s={r.full_s:.6f} full_gbps={gbps:.3f} calls_ns={r.calls_ns:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
