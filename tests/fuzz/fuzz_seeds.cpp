// Writes the fuzzers' seed corpora: fuzz_seeds OUT_DIR [REPO_ROOT]
//   OUT_DIR/wire       one real frame of every message type (wire::encode, plausible values)
//   OUT_DIR/handlers   raw-mode inputs (length-prefixed frames a prefill or decode peer sends, named
//                      after fuzz_handlers' fixture) and structured-mode starters
//   OUT_DIR/metadata   real metadata blobs of a keyed and a keyless context, and a Hello to be signed
//   OUT_DIR/directory_json  answers of etcd's gateway, as the directory reads them
//   OUT_DIR/profile    the shipped profiles (REPO_ROOT/examples/disagg/data/profile-*.json), the
//                      example of docs/profiles.md and the canonical default
//   OUT_DIR/bootstrap  real handshake transcripts, recorded between two contexts through a relay
// scripts/fuzz.sh --seeds regenerates tests/fuzz/corpus with it. File names are stable, so a
// regenerated corpus only differs where the encodings did.
#include "fuzz_common.hpp"

#include "core/selection.hpp"
#include "select/select.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using namespace sg;

namespace {

fs::path g_out;

void write(const std::string &dir, const std::string &name, std::span<const uint8_t> bytes) {
    fs::create_directories(g_out / dir);
    std::ofstream f(g_out / dir / name, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char *>(bytes.data()), std::streamsize(bytes.size()));
}

void write(const std::string &dir, const std::string &name, const std::string &text) {
    write(dir, name, std::span<const uint8_t>(reinterpret_cast<const uint8_t *>(text.data()), text.size()));
}

std::vector<uint8_t> with_mode(uint8_t mode, std::span<const uint8_t> rest) {
    std::vector<uint8_t> v{mode};
    v.insert(v.end(), rest.begin(), rest.end());
    return v;
}

constexpr uint64_t kPeer = 0x5eed5eed5eed5eedull;  // sender id in the wire seeds (handlers overwrites it)

// ---- one frame of every type -----------------------------------------------------------------------

struct Frame {
    std::string name;
    std::vector<uint8_t> bytes;
};

template <class M> Frame frame(const std::string &name, const M &m) {
    Frame f{name, {}};
    wire::encode(f.bytes, kPeer, m);
    return f;
}

Frame frame(const std::string &name, const wire::TransferError &m, wire::MsgType t) {
    Frame f{name, {}};
    wire::encode(f.bytes, kPeer, m, t);
    return f;
}

// A's pool as fuzz_handlers' fixture exports it: 2 layers, 2 heads, dim 16, 4-token blocks, 8 blocks.
wire::LayoutDesc pool_desc() {
    wire::LayoutDesc d;
    d.num_layers = fuzz::HostPool::kLayers;
    d.num_kv_heads = fuzz::HostPool::kHeads;
    d.head_dim = fuzz::HostPool::kDim;
    d.tokens_per_block = fuzz::HostPool::kTokensPerBlock;
    d.num_blocks = fuzz::HostPool::kBlocks;
    d.dtype = SG_DTYPE_FP16;
    d.packing = SG_KV_SEPARATE;
    d.block_order = SG_BLOCK_TOKEN_MAJOR;
    d.mem_kind = SG_MEM_HOST;
    d.block_stride_bytes = uint64_t(d.tokens_per_block) * d.num_kv_heads * d.head_dim * 2;
    return d;
}

std::vector<Frame> every_type(const wire::Hello &hello) {
    std::vector<Frame> v;
    v.push_back(frame("hello", hello));
    {
        wire::HandleExport m;
        m.handle_id = 0x1234;
        m.layout = pool_desc();
        m.regions_per_layer = 2;
        for (uint64_t i = 0; i < 4; ++i) m.regions.push_back({0x100 + i, 0, m.layout.num_blocks * m.layout.block_stride_bytes});
        v.push_back(frame("handle_export", m));
        // The staging area's descriptor, as open_session sends it.
        wire::HandleExport s;
        s.handle_id = 0;
        s.regions_per_layer = 1;
        s.layout.num_layers = 1;
        s.layout.num_kv_heads = 1;
        s.layout.head_dim = 2048;
        s.layout.tokens_per_block = 1;
        s.layout.dtype = SG_DTYPE_FP8_E4M3;
        s.layout.packing = SG_KV_FUSED;
        s.layout.block_stride_bytes = 4096;
        s.layout.num_blocks = core::StagingArea::kSlots * core::StagingArea::kSlotBytes / 4096;
        s.regions.push_back({0x200, 0, core::StagingArea::kSlots * core::StagingArea::kSlotBytes});
        v.push_back(frame("handle_export_staging", s));
    }
    v.push_back(frame("expect", wire::Expect{"pf", 7, 0x1234, 16, {0, 1, 2, 3}}));
    v.push_back(frame("layer_ready", wire::LayerReady{1, 0, 2048, 0}));
    v.push_back(frame("staged_chunk", wire::StagedChunk{1, 1, 0, 0, {{0, 0, 256}, {1, 512, 256}}}));
    v.push_back(frame("staging_credit", wire::StagingCredit{3}));
    v.push_back(frame("transfer_done", wire::TransferDone{1, 4096}));
    v.push_back(frame("cancel", wire::TransferError{"ef", 1, SG_ERR_CANCELED, "canceled by the host", 1}, wire::MsgType::Cancel));
    v.push_back(frame("error", wire::TransferError{"pf", 7, SG_ERR_DEADLINE, "missed its deadline", 0}, wire::MsgType::Error));
    v.push_back(frame("bye", wire::Bye{}));
    {
        wire::Bye reply;
        reply.reply = 1;
        v.push_back(frame("bye_reply", reply));
    }
    v.push_back(frame("ping", wire::Ping{123456789}));
    v.push_back(frame("notify", wire::Notify{{'f', 'i', 'r', 's', 't', ' ', 't', 'o', 'k', 'e', 'n'}}));
    v.push_back(frame("auth_challenge", wire::AuthChallenge{std::vector<uint8_t>(wire::kNonceBytes, 0x11)}));
    v.push_back(frame("auth_proof", wire::AuthProof{std::vector<uint8_t>(wire::kMacBytes, 0x22)}));
    v.push_back(frame("auth_result", wire::AuthResult{1, std::vector<uint8_t>(wire::kMacBytes, 0x33)}));
    v.push_back(frame("auth_result_refused", wire::AuthResult{0, {}}));
    v.push_back(frame("quiesced", wire::Quiesced{1}));
    v.push_back(frame("cancel_ack", wire::CancelAck{"pf", 1}));
    v.push_back(frame("reposted", wire::Reposted{"pf"}));
    v.push_back(frame("selective", wire::Selective{2, SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE}));
    {
        wire::Digests m{2, 0, 0, 2, 2, {}};
        m.data.assign(size_t(m.count) * kernels::digest_floats(1, fuzz::HostPool::kHeads, fuzz::HostPool::kDim) * m.elem_bytes, 0x3c);
        v.push_back(frame("digests", m));
    }
    v.push_back(frame("blocks_ready", wire::BlocksReady{2, 0, SG_PATH_PROACTIVE, 1024, 1, {0, 3}, 1, 0}));
    v.push_back(frame("fetch", wire::Fetch{"ps", 9, 1, {1, 2}}));
    v.push_back(frame("transfer_ack", wire::TransferAck{7}));
    v.push_back(frame("opened", wire::Opened{0, ""}));
    v.push_back(frame("opened_refused", wire::Opened{SG_ERR_NO_PROVIDER, "no provider in common with the peer"}));
    return v;
}

// ---- handlers: what a peer says over a session ----------------------------------------------------------

void append_record(std::vector<uint8_t> &in, std::span<const uint8_t> frame) {
    in.push_back(uint8_t(frame.size()));
    in.push_back(uint8_t(frame.size() >> 8));
    in.insert(in.end(), frame.begin(), frame.end());
}

void append_progress(std::vector<uint8_t> &in) {
    in.push_back(0);
    in.push_back(0);
}

void handler_seeds(const std::vector<Frame> &frames) {
    auto by_name = [&](const std::string &n) -> std::span<const uint8_t> {
        for (auto &f : frames)
            if (f.name == n) return f.bytes;
        std::abort();
    };
    // Each frame alone (raw mode).
    for (auto &f : frames) {
        std::vector<uint8_t> in{0x00};
        append_record(in, f.bytes);
        write("handlers", "raw-" + f.name, in);
    }
    // A prefill peer answering B's expect "ef" (id 1): staged chunk, layer notices, done, quiesced.
    {
        std::vector<uint8_t> in{0x00};
        for (const char *n : {"staged_chunk", "layer_ready", "transfer_done", "quiesced"}) {
            append_record(in, by_name(n));
            append_progress(in);
        }
        write("handlers", "raw-prefill-transcript", in);
    }
    // A decode peer: expects "pf", fetches, cancels, acknowledges.
    {
        std::vector<uint8_t> in{0x00};
        for (const char *n : {"expect", "staging_credit", "fetch", "cancel_ack", "transfer_ack"}) {
            append_record(in, by_name(n));
            append_progress(in);
        }
        write("handlers", "raw-decode-transcript", in);
    }
    // Selective: the peer makes "es" selective, sends digests and a blocks-ready notice.
    {
        std::vector<uint8_t> in{0x00};
        for (const char *n : {"selective", "digests", "blocks_ready"}) append_record(in, by_name(n));
        write("handlers", "raw-selective-transcript", in);
    }
    // Structured mode: starters the mutator grows (op, type and field choices from these bytes).
    const uint8_t structured[][24] = {
        {0x01, 0x00, 0x02, 0x00, 0x00, 0x03, 0x01, 0x00, 0x00, 0x04, 0x00, 0x00, 0x10, 0x02, 0x07},
        {0x01, 0x00, 0x13, 0x01, 0x02, 0x14, 0x01, 0x00, 0x00, 0x02, 0x15, 0x01, 0x00, 0x03, 0x0f},
        {0x01, 0x0e, 0x05, 0x00, 0x01, 0x0f, 0x06, 0x01, 0x02, 0x03, 0x0e, 0x0d, 0x0c, 0x0b, 0x03},
        {0xf5, 0x00, 0x03, 0x02, 0x02, 0x00, 0x00, 0x10, 0x04, 0x00, 0x0c, 0x0d, 0x00, 0x01, 0x08},
        {0xfd, 0x0e, 0x0d, 0x0e, 0x01, 0x00, 0x00, 0x01, 0x0c, 0x00, 0x0e, 0x05, 0x00, 0x02, 0x0d},
    };
    for (size_t i = 0; i < std::size(structured); ++i)
        write("handlers", "structured-" + std::to_string(i), std::span<const uint8_t>(structured[i], 16));
    // Fresh sessions: authenticated (0xf4) and from blobs (0xfc, frames held until the proofs pass).
    {
        std::vector<uint8_t> in{0xfc};
        append_record(in, by_name("layer_ready"));
        append_record(in, by_name("auth_challenge"));
        append_progress(in);
        write("handlers", "raw-fresh-blob-session", in);
        in[0] = 0xf4;
        write("handlers", "raw-fresh-session", in);
    }
}

// ---- bootstrap: a handshake recorded through a relay ------------------------------------------------------

struct Transcript {
    std::vector<uint8_t> from_connector, from_acceptor;
};

Transcript record_handshake(core::Context &connector, core::Context &acceptor) {
    int c[2], a[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, c) || ::socketpair(AF_UNIX, SOCK_STREAM, 0, a)) std::abort();
    Transcript t;
    std::thread tc([&] {
        try {
            core::bootstrap_exchange(c[0], connector, 2000000000ull, core::auth::Role::Connector);
        } catch (const Error &e) {
            std::fprintf(stderr, "fuzz_seeds: connector: %s\n", e.message().c_str());
        }
        ::shutdown(c[0], SHUT_WR);
    });
    std::thread ta([&] {
        try {
            core::bootstrap_exchange(a[0], acceptor, 2000000000ull, core::auth::Role::Acceptor);
        } catch (const Error &e) {
            std::fprintf(stderr, "fuzz_seeds: acceptor: %s\n", e.message().c_str());
        }
        ::shutdown(a[0], SHUT_WR);
    });
    // Relay c[1] <-> a[1], keeping what each side sent.
    bool c_open = true, a_open = true;
    while (c_open || a_open) {
        pollfd p[2] = {{c[1], short(c_open ? POLLIN : 0), 0}, {a[1], short(a_open ? POLLIN : 0), 0}};
        if (::poll(p, 2, 3000) <= 0) break;
        uint8_t buf[4096];
        if (p[0].revents) {
            const ssize_t k = ::read(c[1], buf, sizeof buf);
            if (k <= 0) c_open = false, ::shutdown(a[1], SHUT_WR);
            else t.from_connector.insert(t.from_connector.end(), buf, buf + k), (void)!::write(a[1], buf, size_t(k));
        }
        if (p[1].revents) {
            const ssize_t k = ::read(a[1], buf, sizeof buf);
            if (k <= 0) a_open = false, ::shutdown(c[1], SHUT_WR);
            else t.from_acceptor.insert(t.from_acceptor.end(), buf, buf + k), (void)!::write(c[1], buf, size_t(k));
        }
    }
    tc.join();
    ta.join();
    for (int fd : {c[0], c[1], a[0], a[1]}) ::close(fd);
    return t;
}

// Splits a recorded stream into its frames.
std::vector<std::vector<uint8_t>> frames_of(const std::vector<uint8_t> &stream) {
    std::vector<std::vector<uint8_t>> out;
    size_t at = 0;
    while (stream.size() - at >= wire::kFrameHeaderBytes) {
        const size_t body = size_t(stream[at + 20]) | size_t(stream[at + 21]) << 8 | size_t(stream[at + 22]) << 16 |
                            size_t(stream[at + 23]) << 24;
        const size_t n = std::min(stream.size() - at, wire::kFrameHeaderBytes + body);
        out.emplace_back(stream.begin() + long(at), stream.begin() + long(at + n));
        at += n;
    }
    return out;
}

void bootstrap_seeds() {
    auto keyed_a = fuzz::make_context(true), keyed_b = fuzz::make_context(true);
    auto open_a = fuzz::make_context(false), open_b = fuzz::make_context(false);
    const Transcript keyed = record_handshake(*keyed_a, *keyed_b);
    const Transcript open = record_handshake(*open_a, *open_b);
    // Mode 0: the whole stream of the peer. The target's role is the other end's: a connector's
    // stream is read by an acceptor (bit 0 clear), an acceptor's by a connector (bit 0 set).
    write("bootstrap", "stream-keyed-from-connector", with_mode(0x00, keyed.from_connector));
    write("bootstrap", "stream-keyed-from-acceptor", with_mode(0x01, keyed.from_acceptor));
    write("bootstrap", "stream-keyless-from-connector", with_mode(0x02, open.from_connector));
    write("bootstrap", "stream-keyless-from-acceptor", with_mode(0x03, open.from_acceptor));
    // Modes 1 and 2: the harness sends a valid Hello (and proof); the rest is the recorded remainder.
    const auto fc = frames_of(keyed.from_connector);
    if (fc.size() == 3) {
        std::vector<uint8_t> proof_and_verdict = fc[1];
        proof_and_verdict.insert(proof_and_verdict.end(), fc[2].begin(), fc[2].end());
        write("bootstrap", "after-hello", with_mode(0x04, proof_and_verdict));
        write("bootstrap", "after-proof", with_mode(0x08, fc[2]));
    } else {
        std::fprintf(stderr, "fuzz_seeds: the keyed connector sent %zu frames, not 3\n", fc.size());
    }
    // Mode 3: FuzzedDataProvider bytes (fields of the Hello and the verdict).
    const uint8_t fdp[] = {0x01, 0x00, 0x01, 0x00, 0x00, 0x01, 0x10, 0x74, 0x63, 0x70, 0x3b, 0x6f, 0x66, 0x69,
                           0x5f, 0x72, 0x78, 0x6d, 0x00, 0x01, 0x01, 0x00, 0x01, 0x02};
    write("bootstrap", "fields-valid-verdict", with_mode(0x0c, fdp));
    write("bootstrap", "fields-valid-verdict-connector", with_mode(0x0d, fdp));
}

// ---- metadata -----------------------------------------------------------------------------------------------

void metadata_seeds(core::Context &keyed, core::Context &open) {
    write("metadata", "blob-keyed", with_mode(0x00, keyed.metadata()));
    write("metadata", "blob-keyless", with_mode(0x02, open.metadata()));
    // The Hello frame alone: the harness signs it (mode bit 0).
    std::vector<uint8_t> hello;
    wire::encode(hello, keyed.id, keyed.hello());
    write("metadata", "hello-to-sign", with_mode(0x01, hello));
}

// ---- profiles ----------------------------------------------------------------------------------------------

std::string read_text(const fs::path &p) {
    std::ifstream f(p);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
}

void profile_seeds(const fs::path &root) {
    for (const auto &e : fs::directory_iterator(root / "examples" / "disagg" / "data")) {
        const std::string name = e.path().filename().string();
        if (name.rfind("profile-", 0) == 0 && e.path().extension() == ".json") write("profile", name, read_text(e.path()));
    }
    // The example of docs/profiles.md (its first json block).
    const std::string doc = read_text(root / "docs" / "profiles.md");
    const size_t start = doc.find("```json\n");
    const size_t end = start == std::string::npos ? start : doc.find("```", start + 8);
    if (end != std::string::npos) write("profile", "docs-example.json", doc.substr(start + 8, end - start - 8));
    write("profile", "default-32x8.json", select::to_json(core::default_profile(32, 8, 16)));
    write("profile", "tokens-bytes-budgets.json",
          std::string(R"({"version":1,"model":"m","num_layers":2,"num_kv_heads":2,"block_tokens":4,"combine":"sum","pool":3,)"
                      R"("total_budget":{"tokens":64},"defaults":{"policy":"snapkv","budget":{"bytes":4096},"sinks":4,)"
                      R"("recent":8},"layers":[{"layer":1,"policy":"h2o","budget":{"tokens":16},)"
                      R"("heads":[{"head":0,"policy":"sinks_recent"}]}]})"));
}

// ---- etcd answers ----------------------------------------------------------------------------------

// What etcd 3.4's gateway answered the directory's calls (captured from a real member): a lease
// grant and keep-alive, a range with and without kvs, a watch stream with a put and a delete, and
// an error.
void directory_json_seeds() {
    const std::string header = R"("header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952",)"
                               R"("revision":"3","raft_term":"2"})";
    write("directory_json", "lease-grant.json", "{" + header + R"(,"ID":"2324035766029560581","TTL":"2"})");
    write("directory_json", "keepalive.json", R"({"result":{)" + header + R"(,"ID":"2324035766029560583","TTL":"2"}})");
    write("directory_json", "range-empty.json", "{" + header + "}");
    write("directory_json", "range.json",
          "{" + header +
              R"(,"kvs":[{"key":"L3NtYXJ0Z2VuL2VuZ2luZXMvcHJlZmlsbC0w","create_revision":"2","mod_revision":"2",)"
              R"("version":"1","value":"U0dXMQEAAwAB","lease":"2324035766029560581"}],"count":"1"})");
    write("directory_json", "watch.json",
          R"({"result":{)" + header + R"(,"created":true}})" "\n" R"({"result":{)" + header +
              R"(,"events":[{"kv":{"key":"Zm9v","create_revision":"2","mod_revision":"2","version":"1","value":"YmFy"}}]}})"
              "\n" R"({"result":{)" + header + R"(,"events":[{"type":"DELETE","kv":{"key":"Zm9v","mod_revision":"3"}}]}})");
    write("directory_json", "error.json",
          R"({"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5})");
    write("directory_json", "escapes.json", R"({"a":"\u00e9\ud83d\ude00\n\"","b":[1,-2.5e3,true,false,null,{}]})");
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s OUT_DIR [REPO_ROOT]\n", argv[0]);
        return 2;
    }
    g_out = argv[1];
    const fs::path root = argc > 2 ? fs::path(argv[2]) : fs::current_path();
    auto keyed = fuzz::make_context(true), open = fuzz::make_context(false);

    const auto frames = every_type(keyed->hello());
    for (auto &f : frames) write("wire", f.name, f.bytes);
    handler_seeds(frames);
    metadata_seeds(*keyed, *open);
    profile_seeds(root);
    bootstrap_seeds();
    directory_json_seeds();
    std::printf("fuzz_seeds: wrote %s/{wire,handlers,metadata,profile,bootstrap,directory_json}\n", g_out.c_str());
    return 0;
}
