"""SmartGenConnector: SmartGen behind the verbs a serving engine's KV connector already has.

The worker-side methods mirror vLLM's KVConnectorBase_V1 (register_kv_caches, save_kv_layer,
wait_for_save, start_load_kv, wait_for_layer_load, get_finished), so an engine written against that
interface drives SmartGen without learning a new shape. One connector per engine process; the
session to the peer engine is made by the host (a listener, a connect, or the cluster directory).

Where SmartGen differs from a prefix-only connector: with selective=True the decode side may start
on each layer's essential blocks (wait_for_layer_load returns at SG_LAYER_ESSENTIAL) and reads
visible_blocks(request, layer) to know which blocks it may attend to; the rest arrive by the
speculative path (or by fetch()) while it runs, until the transfer completes and every block is
visible. vLLM's get_num_new_matched_tokens can only report a contiguous prefix as available, so a
real vLLM integration reports the whole prompt as "external" and relies on this layer-level wait,
and its attention kernels need the block mask; SGLang's page-index KVReceiver fits directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import smartgen


@dataclass
class LoadSpec:
    request_id: str
    block_ids: list
    num_tokens: int


@dataclass
class _Active:
    transfer: smartgen.Transfer
    spec: LoadSpec
    essential: set = field(default_factory=set)


class SmartGenConnector:
    def __init__(self, role: str, session: smartgen.Session, *, selective: bool = False,
                 profile: smartgen.Profile | None = None, timeout: float = 30.0):
        if role not in ("producer", "consumer"):
            raise ValueError("role is 'producer' (prefill) or 'consumer' (decode)")
        if selective and role == "producer" and profile is None:
            raise ValueError("a selective producer needs the selection profile")
        self.role, self.session, self.selective, self.profile, self.timeout = role, session, selective, profile, timeout
        self.pool: smartgen.Pool | None = None
        self._saving: dict[str, _Active] = {}
        self._loading: dict[str, _Active] = {}

    # ---- both sides ----
    def register_kv_caches(self, k, v=None, **layout) -> smartgen.Pool:
        """The engine's KV cache, registered where it lives and exported to the peer (see
        smartgen.Context.register_pool for the shapes taken)."""
        self.pool = self.session.context.register_pool(k, v, **layout)
        self.session.export(self.pool)
        return self.pool

    def get_finished(self) -> tuple[set, set]:
        """(finished sending, finished receiving) request ids since the last call; their transfers are
        released, so their blocks may be reused. A failed transfer raises smartgen.Error."""
        done = []
        for table in (self._saving, self._loading):
            ids = set()
            for rid, a in list(table.items()):
                st = a.transfer.test()
                if st == smartgen.SG_IN_PROGRESS:
                    continue
                table.pop(rid)
                a.transfer.release()
                if st != smartgen.SG_OK:
                    raise smartgen.Error(st, f"request {rid}: {a.transfer.status[1] if not a.transfer.closed else ''}")
                ids.add(rid)
            done.append(ids)
        return done[0], done[1]

    # ---- producer (prefill) ----
    def start_save(self, spec: LoadSpec) -> None:
        """Prefill: the request's KV will be written into these blocks, layer by layer."""
        paths = smartgen.PATHS_SELECTIVE if self.selective else smartgen.PATH_FULL
        t = self.session.post(spec.request_id, self.pool, spec.block_ids, spec.num_tokens, paths=paths,
                              profile=self.profile if self.selective else None)
        self._saving[spec.request_id] = _Active(t, spec)

    def save_kv_layer(self, layer: int) -> None:
        """Prefill wrote this layer of every saving request: its blocks may go now."""
        for a in self._saving.values():
            a.transfer.layer_written(layer)

    def wait_for_save(self) -> None:
        """Until the peer holds every byte of every saving request."""
        for a in self._saving.values():
            a.transfer.wait(self.timeout)

    # ---- consumer (decode) ----
    def start_load_kv(self, specs: list[LoadSpec]) -> None:
        """Decode: these requests' KV lands in these blocks of the registered pool."""
        for spec in specs:
            t = self.session.expect(spec.request_id, self.pool, spec.block_ids, spec.num_tokens)
            self._loading[spec.request_id] = _Active(t, spec)

    def wait_for_layer_load(self, layer: int) -> None:
        """Until the layer may be attended to: all of it, or (selective) its essential blocks."""
        bits = smartgen.LAYER_ESSENTIAL if self.selective else smartgen.LAYER_READY
        for a in self._loading.values():
            if a.transfer.test() == smartgen.SG_OK:
                continue
            a.transfer.wait_layer_state(layer, bits, self.timeout)

    def visible_blocks(self, request_id: str, layer: int) -> list[bool] | None:
        """Which of the request's blocks hold their bytes in this layer; None once all of them do."""
        a = self._loading.get(request_id)
        if a is None or a.transfer.test() == smartgen.SG_OK:
            return None
        return a.transfer.residency(layer)

    def fetch(self, request_id: str, layer: int, blocks: list[int]) -> None:
        """On demand: ask for blocks decode needs now (logical indices into the request's table)."""
        self._loading[request_id].transfer.fetch(layer, blocks)

    def stats(self, request_id: str) -> dict:
        a = self._loading.get(request_id) or self._saving.get(request_id)
        return a.transfer.stats()
