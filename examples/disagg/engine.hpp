// examples/disagg/engine: a small Llama inference engine for llama2.c checkpoints, the compute part
// of the smartgen-disagg demo. The demo connects it to the runtime through the C ABI. It uses
// nothing of SmartGen but two calls of the public header, sg_attention_merge and
// sg_attention_finish, for parallel on-demand attention (AttendSet::arriving); it looks them up in
// the process when first needed (dlsym), so a program that never passes arriving links and runs
// without libsmartgen, and one that does gets an EngineError if no libsmartgen 0.2 or later is
// loaded.
//
// Conventions are those of llama2.c's run.c (GQA version): legacy v0 checkpoint, RMSNorm eps 1e-5,
// RoPE on adjacent pairs (2i, 2i+1) within each head with freq = 10000^-(2i/head_size), applied to q
// and to k; scores scaled by 1/sqrt(head_size); causal softmax; SwiGLU FFN; greedy argmax (first
// maximum wins). Token ids are passed as they are: a prompt already starts with BOS (1).
//
// The KV cache lives in a paged pool that the caller owns, in SmartGen's layout (SG_KV_SEPARATE,
// SG_BLOCK_TOKEN_MAJOR): per layer a K region and a V region, each an array of blocks; block b of a
// region holds tokens_per_block tokens as [token][kv_head][head_dim] elements of the pool's dtype. A
// request's block table maps logical block j (positions j*B .. j*B+B-1) to a physical block id.
//
// Numerics: every sum is accumulated in run.c's order (matmul outputs over the input index, scores
// over the head dimension, attention outputs over positions in order), and no multiply-add is fused;
// the kernels vectorise only across independent sums. So with an fp32 pool the logits are bit-identical
// to run.c's, a prompt prefilled layer by layer gives the same K/V and logits as the same tokens fed
// one at a time through decode_step, and the physical placement of blocks never changes a result.
// The one exception is a step with arriving blocks (AttendSet::arriving): its two merged parts
// round differently from the one softmax, so it equals the step without them up to float rounding
// (engine_test measures it), not bit for bit.
//
// Thread safety: a Model is immutable after loading and may be shared; a RunState belongs to one
// thread at a time. Errors are reported by throwing EngineError with a message that names the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace sg::disagg {

class EngineError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// ---- model --------------------------------------------------------------------------------------

struct Config {
    int dim = 0;
    int hidden_dim = 0;
    int n_layers = 0;
    int n_heads = 0;
    int n_kv_heads = 0;
    int vocab_size = 0;  // always positive here; see shared_classifier
    int seq_len = 0;
    bool shared_classifier = true;  // header vocab_size > 0: logits use the token embedding

    int head_size() const { return dim / n_heads; }
    int kv_dim() const { return n_kv_heads * head_size(); }
    int kv_mul() const { return n_heads / n_kv_heads; }
};

// Pointers into the mapped checkpoint. Matrices are [out][in], row-major; per-layer arrays are
// stacked layer after layer.
struct Weights {
    const float* token_embedding = nullptr;  // [vocab][dim]
    const float* rms_att = nullptr;          // [layer][dim]
    const float* wq = nullptr;               // [layer][dim][dim]
    const float* wk = nullptr;               // [layer][kv_dim][dim]
    const float* wv = nullptr;               // [layer][kv_dim][dim]
    const float* wo = nullptr;               // [layer][dim][dim]
    const float* rms_ffn = nullptr;          // [layer][dim]
    const float* w1 = nullptr;               // [layer][hidden][dim]
    const float* w2 = nullptr;               // [layer][dim][hidden]
    const float* w3 = nullptr;               // [layer][hidden][dim]
    const float* rms_final = nullptr;        // [dim]
    const float* wcls = nullptr;             // [vocab][dim]; == token_embedding when shared
};

class Model {
  public:
    // Maps a legacy (v0) llama2.c checkpoint read-only. Throws EngineError when the file cannot be
    // opened, the header is invalid (non-positive sizes, dim not divisible by n_heads, n_heads not
    // divisible by n_kv_heads, odd head size), it is a versioned export ("ak42" magic), or its size
    // differs from the one the header implies (the message gives both).
    static Model load(const std::string& path);

    Model(Model&&) noexcept;
    Model& operator=(Model&&) noexcept;
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;
    ~Model();

    const Config& config() const { return config_; }
    const Weights& weights() const { return weights_; }
    // RoPE rotation for position pos and pair i (0 <= i < head_size/2), computed as run.c does.
    float rope_cos(int pos, int i) const { return rope_cos_[size_t(pos) * (config_.head_size() / 2) + i]; }
    float rope_sin(int pos, int i) const { return rope_sin_[size_t(pos) * (config_.head_size() / 2) + i]; }
    size_t file_bytes() const { return map_bytes_; }

    // Bytes a checkpoint with this (raw, possibly negative vocab_size) header must have, or 0 when
    // the header is not a valid one. Exposed for tools and tests.
    static uint64_t expected_file_bytes(const int32_t header[7]);

  private:
    Model() = default;
    Config config_{};
    Weights weights_{};
    void* map_ = nullptr;
    size_t map_bytes_ = 0;
    std::vector<float> rope_cos_, rope_sin_;  // [seq_len][head_size/2]
};

// ---- paged KV pool --------------------------------------------------------------------------------

// Values equal SmartGen's sg_dtype_t (SG_DTYPE_FP32/FP16/BF16).
enum class KvDtype : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

size_t dtype_bytes(KvDtype dtype);
const char* dtype_name(KvDtype dtype);

// Conversions used for fp16/bf16 pools: round to nearest, ties to even; NaN stays NaN (quiet),
// overflow gives infinity, fp16 subnormals are produced and read exactly.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t b);

// A non-owning view of a paged pool (the same facts as an sg_kv_layout_t with SG_KV_SEPARATE and
// SG_BLOCK_TOKEN_MAJOR). Block b of layer l's K region starts at k_base[l] + b * block_stride().
struct KvPool {
    int num_layers = 0;
    int num_kv_heads = 0;
    int head_dim = 0;
    int tokens_per_block = 0;
    uint64_t num_blocks = 0;  // per layer
    KvDtype dtype = KvDtype::kF32;
    std::vector<void*> k_base;        // num_layers pointers
    std::vector<void*> v_base;        // num_layers pointers
    uint64_t block_stride_bytes = 0;  // 0 = packed (plane_bytes())

    uint64_t plane_bytes() const {
        return uint64_t(tokens_per_block) * uint64_t(num_kv_heads) * uint64_t(head_dim) * dtype_bytes(dtype);
    }
    uint64_t block_stride() const { return block_stride_bytes ? block_stride_bytes : plane_bytes(); }
    uint64_t region_bytes() const { return num_blocks * block_stride(); }

    // Throws EngineError unless the pool fits the model (layers, KV heads, head size) and is well formed.
    void check(const Config& config) const;

    // Element address of (layer, K or V, physical block, slot in block, kv_head, 0).
    void* row(int layer, bool is_v, uint32_t block, int slot, int kv_head) const;
};

// Owns the memory of a packed pool shaped for a model (zero-filled, one K and one V allocation per
// layer, 64-byte aligned) and hands out views of it.
class KvPoolStorage {
  public:
    KvPoolStorage(const Config& config, int tokens_per_block, uint64_t num_blocks, KvDtype dtype = KvDtype::kF32);
    const KvPool& view() const { return view_; }
    void clear();  // zero every block

  private:
    struct Free {
        void operator()(void* p) const;
    };
    KvPool view_;
    std::vector<std::unique_ptr<void, Free>> regions_;
};

// Logical block j of a request -> physical block id. uint32_t like sg_transfer_post's block_ids.
using BlockTable = std::span<const uint32_t>;

inline uint32_t blocks_for(int n_tokens, int tokens_per_block) {
    return uint32_t((n_tokens + tokens_per_block - 1) / tokens_per_block);
}
std::vector<uint32_t> identity_table(uint32_t n_blocks);

// Reads position pos of (layer, K or V, kv_head) from the pool into out[head_dim], converted to fp32.
void read_kv(const KvPool& pool, BlockTable table, int layer, bool is_v, int pos, int kv_head, float* out);

// ---- run state and outputs ------------------------------------------------------------------------

// Scratch for one request at a time, sized once for the model's seq_len so that neither prefill nor
// decode allocates per token.
class RunState {
  public:
    explicit RunState(const Config& config);
    RunState(RunState&&) noexcept;
    RunState& operator=(RunState&&) noexcept;
    ~RunState();
    std::span<const float> logits() const;

    struct Buffers;  // defined in engine.cpp; internal
    Buffers& buffers() { return *b_; }

  private:
    std::unique_ptr<Buffers> b_;
};

// What prefill may capture for window-attention (SnapKV-style) scoring. Filled for layer l before
// on_layer_written(l) is called, so a transport can score and ship layer l at once.
struct PrefillCapture {
    int n_tokens = 0;
    int window = 0;  // rows captured: min(PrefillOptions::window, n_tokens)
    int n_layers = 0, n_heads = 0, head_size = 0;
    // Queries of the last `window` prompt positions after RoPE (unscaled): [layer][head][row][head_size];
    // row r is position n_tokens - window + r.
    std::vector<float> queries;
    // Attention mass each key position received from those queries: [layer][head][n_tokens], the sum
    // over the window rows of their causal softmax probabilities (each row sums to 1).
    std::vector<float> window_attention;

    const float* query(int layer, int head, int row) const {
        return queries.data() + ((size_t(layer) * n_heads + head) * window + row) * head_size;
    }
    const float* attention(int layer, int head) const {
        return window_attention.data() + (size_t(layer) * n_heads + head) * n_tokens;
    }
};

struct PrefillOptions {
    // Called once per layer, in order, on the calling thread, as soon as layer l's K and V for every
    // prompt token are in the pool (and, with a capture, right after the window rows were scored),
    // before layer l's remaining attention, its FFN and all later layers are computed. This call does
    // not write layer l's blocks again, so another thread may read them from then on.
    std::function<void(int layer)> on_layer_written;
    int window = 0;                     // last W queries to capture; 0 = none
    PrefillCapture* capture = nullptr;  // required when window > 0
};

// Per decode step, per layer: which logical blocks of the prompt the new token attends to.
struct AttendSet {
    // Positions >= prompt_len (tokens generated during decode) are always attended, and so is the
    // current position.
    int prompt_len = 0;
    // [layer] -> strictly ascending logical block indices (each < blocks_for(prompt_len, B)).
    std::vector<std::vector<uint32_t>> layer_blocks;
    // Optional per-layer selection, for selectors that need the step's query of each layer: when set,
    // decode_step calls it once per layer, in order, on the calling thread, after the layer's query
    // (q: [n_heads][head_size], after RoPE, unscaled) and the current position's K/V are computed
    // (the K/V already stored in the pool) and before the layer's attention. It returns the layer's
    // logical prompt blocks (same rules as layer_blocks; the vector must stay valid until the next
    // call), or nullptr for every prompt block. layer_blocks is then ignored and may be empty.
    std::function<const std::vector<uint32_t>*(int layer, const float* q)> select = nullptr;
    // Optional, with select: parallel on-demand attention. After select(l, q) returned the layer's
    // set, decode_step calls arriving(l): the blocks of that set still in flight (ascending, a subset
    // of it; nullptr or empty: none). The step attends to the rest first, then calls wait_arriving(l)
    // and attends to the arriving blocks, and merges the two parts exactly (sg_attention_merge).
    std::function<const std::vector<uint32_t>*(int layer)> arriving = nullptr;
    std::function<void(int layer)> wait_arriving = nullptr;
};

// True (unmasked) attention of one decode step: for each layer and query head the softmax over all
// positions 0..pos, computed from the same query even when an AttendSet restricts what the step uses.
// Requires every position's K to be valid in the pool.
struct AttentionProbe {
    int n_layers = 0, n_heads = 0, n_pos = 0;
    std::vector<float> probs;  // [layer][head][n_pos]
    const float* row(int layer, int head) const { return probs.data() + (size_t(layer) * n_heads + head) * n_pos; }
};

// ---- inference ------------------------------------------------------------------------------------

// Runs the prompt tokens (positions 0..n-1) layer by layer over all tokens, writes their K/V to the
// pool through `table` (which must cover blocks_for(n, B) blocks), and returns the logits of the last
// position (a view into state, valid until its next use). Throws EngineError on a bad argument.
std::span<const float> prefill(const Model& model, const KvPool& pool, BlockTable table, std::span<const int> tokens,
                               RunState& state, const PrefillOptions& options = {});

// Runs `token` at position `pos` (0 <= pos < seq_len): writes its K/V to the pool and attends to
// positions 0..pos (restricted by `attend` when given, except the current position and positions >=
// attend->prompt_len). With `probe`, also records the true attention over 0..pos (in a layer with
// arriving blocks, after wait_arriving). Returns the logits. An arriving answer that is not
// ascending, names a block outside the layer's set, or comes without wait_arriving is an EngineError.
std::span<const float> decode_step(const Model& model, const KvPool& pool, BlockTable table, int pos, int token,
                                   RunState& state, const AttendSet* attend = nullptr, AttentionProbe* probe = nullptr);

// Index of the largest logit; the first one wins a tie (run.c's argmax).
int argmax(std::span<const float> logits);

// Prefill + greedy generation of n_new tokens (the first from the prefill logits) with full attention,
// in the caller's pool. Needs prompt.size() + n_new - 1 <= seq_len.
std::vector<int> colocated(const Model& model, const KvPool& pool, BlockTable table, std::span<const int> prompt,
                           int n_new, RunState& state);

struct ColocatedOptions {
    int tokens_per_block = 16;
    KvDtype dtype = KvDtype::kF32;
};
// The same in a private pool with an identity block table.
std::vector<int> colocated(const Model& model, std::span<const int> prompt, int n_new,
                           const ColocatedOptions& options = {});

}  // namespace sg::disagg
