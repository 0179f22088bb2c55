// runtime/transport/fake: an in-memory fabric for deterministic tests. Every fake endpoint of the
// process attaches to the one Fabric a test installed; everything the fabric decides (delays,
// reordering within the promised ordering, EAGAIN, held completions, provider keys) comes from its
// own seeded PRNG, so one seed replays one schedule exactly. Nothing moves between polls: a write
// lands and a message arrives when the target polls, a completion when the initiator does.
// Depends on common/ and transport.hpp. docs/testing.md says what it models and what it does not.
#pragma once

#include "transport/transport.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace sg::transport::fake {

// splitmix64: small, fast and the same everywhere, so a seed means the same schedule on every
// machine (std::mt19937's distributions are not specified bit for bit).
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed) {}
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    uint64_t below(uint64_t n) { return n ? next() % n : 0; }          // [0, n)
    bool chance(double p) { return p > 0 && double(next() >> 11) * 0x1.0p-53 < p; }
};

// What the fabric's endpoints report and how the fabric schedules. Capabilities are read when an
// endpoint opens; the schedule knobs apply from the moment they are set.
struct Knobs {
    // ---- capabilities (transport::Capabilities) ----
    bool send_after_write = true;    // a send never overtakes an earlier write on the same link
    bool provider_keys = false;      // FI_MR_PROV_KEY: the fabric picks keys, requested ones are ignored
    bool virt_addr = false;          // FI_MR_VIRT_ADDR: remote addresses are virtual addresses
    bool needs_local_desc = false;   // FI_MR_LOCAL: local buffers must be registered, descs checked
    bool local_only = false;         // shm-like: no connections, operations to a dead peer never complete
    uint64_t max_msg_size = 1ull << 30;
    uint64_t rma_iov_limit = 4;
    // FI_HMEM (CUDA): device memory registers (register_device_memory); a write from device memory
    // must pass that registration's descriptor (FI_MR_HMEM), else it fails with EACCES.
    bool hmem = false;
    // How the fabric reaches device memory, as a NIC's DMA engine would: every copy of a write whose
    // source or target is a device registration goes through it (tests hand it the emulated CUDA
    // plugin's copy, whose memory is unmapped outside its calls). Unset: memcpy.
    std::function<void(void *dst, const void *src, uint64_t len)> device_copy;
    // ---- schedule ----
    double delay = 0;                // chance that an operation waits max_delay_polls target polls or fewer
    uint32_t max_delay_polls = 8;    // (later ones overtake it where the ordering allows)
    double hold = 0;                 // chance that a completion waits max_hold_polls initiator polls or fewer
    uint32_t max_hold_polls = 8;
    double early_completion = 0;     // send_after_write only: a write completes before it lands
                                     // (transmit completion; the source is read at that moment)
    double eagain = 0;               // chance that post_write / post_send answers -EAGAIN
    double broken_posts_throw = 0.5; // chance, per broken link, that later posts throw (else they
                                     // are taken and fail at completion, as rxm does either way)
    uint32_t max_events_per_poll = 64;
    // TCP's late landing: a write whose link drops before it landed fails at its initiator at once,
    // yet (its bytes already in the target's socket) lands this many polls of the target later,
    // unless the target fences the initiator first (Transport::fence). 0: it never lands.
    uint32_t late_landing_polls = 0;
    // Chance that such a late write lands in part at once (a prefix, the key checked then) and the
    // rest at its late time at the same address, even if the key was closed in between: TCP's
    // receiver checks the key when a write's header arrives and then copies the payload as it
    // comes. Only a fence of the initiator stops the rest.
    double partial_landing = 0;
    // Chance that a write lands with one byte flipped (host memory targets): what a torn write or
    // a stale copy leaves, for the checks that must catch it (staged chunks' CRC32C).
    double corrupt_landing = 0;
    bool refuse_device_memory = false;  // hmem: register_device_memory fails (as fi_mr_regattr may)
};

// A write as posted, in posting order (fabric-wide seq): what the scheduler asked for.
struct WriteRecord {
    uint64_t seq;
    uint32_t from, to;   // endpoint ids
    uint64_t key;
    uint64_t offset;       // into the target registration
    uint64_t len;
    uint64_t target_addr;  // where it lands in the target's memory; 0 when the key or range is refused
};

// Writes an endpoint had posted and not yet seen complete, at most: against the context's bounds.
struct Flow {
    uint64_t max_ops = 0, max_bytes = 0;
    uint64_t ops = 0, bytes = 0;  // now
};

class Fabric {
  public:
    // Installs the process's fake fabric (at most one at a time; throws SG_ERR_INVALID_STATE when
    // one is installed). Endpoints opened while it is installed keep it alive after it is uninstalled.
    Fabric(uint64_t seed, const Knobs &knobs);
    ~Fabric();  // uninstalls
    Fabric(const Fabric &) = delete;
    Fabric &operator=(const Fabric &) = delete;

    void set_knobs(const Knobs &knobs);
    // The endpoint id behind an address from local_address() (a peer's metadata carries it).
    static uint32_t endpoint_id(std::span<const uint8_t> address);
    // The connection between two endpoints breaks: what is pending between them completes with
    // ECONNRESET, and later posts either throw or fail at completion (broken_posts_throw, per link).
    // Once each end has fenced the other, an insert of one by the other connects anew and the link
    // works again (a lane that heals). On a local_only fabric there is no connection to break: this
    // does nothing.
    void drop_link(uint32_t a, uint32_t b);
    // The endpoint's process dies: it is cut off from every peer. Peers' operations to it fail
    // (ECONNRESET) or, local_only, never complete; if the test polls it again (to clean up), its
    // own pending operations fail.
    void kill(uint32_t endpoint);
    // Called before every poll of every endpoint (not re-entered): lets a test drive other contexts
    // and the test clock while a core call blocks (release, close_session), on one thread.
    void on_poll(std::function<void()> hook);

    std::vector<WriteRecord> writes() const;
    Flow flow(uint32_t endpoint) const;
    // The oracle of stale landings (issue 38): host memory the test has handed back to its host
    // (a quiesced transfer's blocks). Every write that lands in such a range from then on, whole
    // or as the rest of a partial landing, is recorded as "<what>: <bytes> at +<offset>".
    void watch_reused(const void *addr, uint64_t len, const std::string &what);
    std::vector<std::string> landings_in_reused() const;
    // Operations and completions the fabric still owes somebody; `stuck` counts those addressed to
    // a dead peer of a local_only fabric, which it never settles.
    size_t pending() const;
    size_t stuck() const;
    uint64_t eagains() const;

    struct State;

  private:
    std::shared_ptr<State> state_;
};

// The transport for provider "fake" (registered with transport::register_test_provider by this
// library, which only the tests link; transport::open dispatches here). Throws SG_ERR_NO_PROVIDER
// when no fabric is installed.
std::unique_ptr<Transport> open_fake(const OpenOptions &options);

}  // namespace sg::transport::fake
