#include "select/select.hpp"

#include "common/json_input.hpp"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <numeric>

namespace sg::select {

namespace {

// ordered_json keeps fields in the order written, so to_json comes out in schema order.
using Json = nlohmann::ordered_json;

constexpr Policy kPolicies[] = {Policy::sinks_recent, Policy::quest, Policy::snapkv, Policy::h2o, Policy::dense};

[[noreturn]] void bad(const std::string &path, const std::string &why) {
    fail(SG_ERR_INVALID_ARGUMENT, "profile: " + path + ": " + why);
}

// Shortest text that reads back as v, as the JSON file would have it.
std::string number_text(double v) { return Json(v).dump(); }

// A value as the file has it, cut short: error messages quote it, and it may be megabytes long.
std::string excerpt(const Json &v) {
    constexpr size_t kMax = 64;
    std::string text = v.dump();
    if (text.size() > kMax) text = text.substr(0, kMax) + "...";
    return text;
}

void check_version(uint32_t version) {
    if (version != Profile::kVersion)
        fail(SG_ERR_VERSION_MISMATCH, "profile: version: " + std::to_string(version) +
                                          " is not supported (this library reads version " +
                                          std::to_string(Profile::kVersion) + ")");
}

std::string join(const std::string &prefix, std::string_view key) {
    return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

std::string indexed(const std::string &prefix, std::string_view key, size_t i) {
    return join(prefix, key) + "[" + std::to_string(i) + "]";
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// ceil(f * n) for a fraction, except that a product within rounding error of an integer is that
// integer: 0.1 * 1000 must be 100, not 101.
uint64_t fraction_of(double f, uint64_t n) {
    const double x = f * double(n);
    const double r = std::round(x);
    if (std::fabs(x - r) <= 1e-9 * std::max(1.0, x)) return uint64_t(r);
    return uint64_t(std::ceil(x));
}

bool is_dense(const Rule &r) { return r.policy == Policy::dense; }

// ---- rule resolution ----

// A resolved (layer, head), and the level its policy came from (0 defaults, 1 layer, 2 head) so an
// error can name the entry to fix.
struct Resolved {
    Rule rule;
    bool has_budget = false;
    int policy_level = 0;
};

Resolved resolve(const Profile &p, const LayerSpec *layer, const HeadSpec *head) {
    Resolved r;
    const RuleSpec *levels[3] = {&p.defaults, layer ? &layer->rule : nullptr, head ? &head->rule : nullptr};
    for (int i = 0; i < 3; ++i) {
        const RuleSpec *s = levels[i];
        if (!s) continue;
        if (s->policy) {
            r.rule.policy = *s->policy;
            r.policy_level = i;
        }
        if (s->budget) {
            r.rule.budget = *s->budget;
            r.has_budget = true;
        }
        if (s->sinks) r.rule.sinks = *s->sinks;
        if (s->recent) r.rule.recent = *s->recent;
    }
    return r;
}

// Visits every (layer, head) with its resolved rule and the indices of its override entries in
// p.layers and in that entry's heads (-1 where none). Assumes the override indices are in range
// and unique (validate checks that first).
template <class F>  // f(layer, head, const Resolved &, layer_entry, head_entry)
void for_each_rule(const Profile &p, F &&f) {
    std::vector<int64_t> layer_entry(p.num_layers, -1), head_entry(p.num_kv_heads);
    for (size_t i = 0; i < p.layers.size(); ++i) layer_entry[p.layers[i].layer] = int64_t(i);
    for (uint32_t l = 0; l < p.num_layers; ++l) {
        const LayerSpec *ls = layer_entry[l] >= 0 ? &p.layers[size_t(layer_entry[l])] : nullptr;
        std::fill(head_entry.begin(), head_entry.end(), -1);
        if (ls)
            for (size_t j = 0; j < ls->heads.size(); ++j) head_entry[ls->heads[j].head] = int64_t(j);
        for (uint32_t h = 0; h < p.num_kv_heads; ++h) {
            const HeadSpec *hs = head_entry[h] >= 0 ? &ls->heads[size_t(head_entry[h])] : nullptr;
            f(l, h, resolve(p, ls, hs), layer_entry[l], head_entry[h]);
        }
    }
}

// ---- validation ----

void check_budget(const Budget &b, const std::string &path) {
    switch (b.kind) {
        case Budget::Kind::fraction:
            if (!(b.fraction > 0.0 && b.fraction <= 1.0))
                bad(path + ".fraction", "must be in (0, 1], got " + number_text(b.fraction));
            return;
        case Budget::Kind::tokens:
        case Budget::Kind::bytes:
            return;
    }
    bad(path, "kind " + std::to_string(int(b.kind)) + " is not tokens, fraction or bytes");
}

void check_spec(const RuleSpec &r, const std::string &path) {
    if (r.policy && std::find(std::begin(kPolicies), std::end(kPolicies), *r.policy) == std::end(kPolicies))
        bad(join(path, "policy"), std::to_string(int(*r.policy)) + " is not a policy");
    if (r.budget) check_budget(*r.budget, join(path, "budget"));
}

// ---- JSON reading ----

const Json *find(const Json &obj, std::string_view key) {
    const auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
}

const Json &required(const Json &obj, const std::string &prefix, std::string_view key) {
    const Json *v = find(obj, key);
    if (!v) bad(join(prefix, key), "missing");
    return *v;
}

void expect_object(const Json &v, const std::string &path) {
    if (!v.is_object()) bad(path, std::string("must be an object, got ") + v.type_name());
}

void allow_only(const Json &obj, const std::string &prefix, std::initializer_list<std::string_view> keys) {
    for (const auto &item : obj.items())
        if (std::find(keys.begin(), keys.end(), item.key()) == keys.end())
            bad(join(prefix, item.key()), "unknown field");
}

uint64_t as_u64(const Json &v, const std::string &path, uint64_t max = UINT64_MAX) {
    if (!v.is_number_unsigned()) bad(path, "must be a non-negative integer, got " + excerpt(v));
    const uint64_t x = v.get<uint64_t>();
    if (x > max) bad(path, "must be <= " + std::to_string(max) + ", got " + std::to_string(x));
    return x;
}

uint32_t as_u32(const Json &v, const std::string &path) { return uint32_t(as_u64(v, path, UINT32_MAX)); }

uint32_t as_positive_u32(const Json &v, const std::string &path) {
    const uint32_t x = as_u32(v, path);
    if (x == 0) bad(path, "must be >= 1");
    return x;
}

std::string as_string(const Json &v, const std::string &path) {
    if (!v.is_string()) bad(path, std::string("must be a string, got ") + v.type_name());
    return v.get<std::string>();
}

Policy as_policy(const Json &v, const std::string &path) {
    const std::string s = as_string(v, path);
    for (Policy p : kPolicies)
        if (s == policy_name(p)) return p;
    bad(path, "unknown policy \"" + s + "\" (expected sinks_recent, quest, snapkv, h2o or dense)");
}

Budget as_budget(const Json &v, const std::string &path) {
    expect_object(v, path);
    if (v.size() != 1) bad(path, "must have exactly one of tokens, fraction, bytes; got " + excerpt(v));
    const auto it = v.begin();
    const std::string key = it.key();
    const Json &value = it.value();
    const std::string at = join(path, key);
    if (key == "tokens") return Budget::of_tokens(as_u64(value, at));
    if (key == "bytes") return Budget::of_bytes(as_u64(value, at));
    if (key == "fraction") {
        if (!value.is_number()) bad(at, std::string("must be a number, got ") + value.type_name());
        const Budget b = Budget::of_fraction(value.get<double>());
        check_budget(b, path);
        return b;
    }
    bad(at, "unknown budget kind (expected tokens, fraction or bytes)");
}

RuleSpec as_rule(const Json &obj, const std::string &prefix) {
    RuleSpec r;
    if (const Json *v = find(obj, "policy")) r.policy = as_policy(*v, join(prefix, "policy"));
    if (const Json *v = find(obj, "budget")) r.budget = as_budget(*v, join(prefix, "budget"));
    if (const Json *v = find(obj, "sinks")) r.sinks = as_u32(*v, join(prefix, "sinks"));
    if (const Json *v = find(obj, "recent")) r.recent = as_u32(*v, join(prefix, "recent"));
    return r;
}

const Json &as_array(const Json &v, const std::string &path) {
    if (!v.is_array()) bad(path, std::string("must be an array, got ") + v.type_name());
    return v;
}

// ---- JSON writing ----
// Text written directly, as nlohmann's dump(indent) lays it out, without building a DOM (a DOM's
// destructor may allocate, which must not happen while a bad_alloc unwinds). Scalars go through
// nlohmann: its number and string forms are what parse_profile reads back.

class Writer {
  public:
    explicit Writer(int indent) : indent_(indent) {}
    void open(char bracket) {
        out_ += bracket;
        ++depth_;
        first_ = true;
    }
    void close(char bracket) {
        --depth_;
        if (!first_) newline();
        out_ += bracket;
        first_ = false;
    }
    void key(const char *k) {
        separate();
        out_.append("\"").append(k).append(indent_ >= 0 ? "\": " : "\":");
    }
    void element() { separate(); }  // before each array element
    void value(uint64_t v) { scalar(std::to_string(v)); }
    void value(double v) { scalar(number_text(v)); }
    void value(const std::string &v) { scalar(Json(v).dump()); }
    std::string take() { return std::move(out_); }

  private:
    void separate() {
        if (!first_) out_ += ',';
        newline();
        first_ = false;
    }
    void newline() {
        if (indent_ < 0) return;
        out_ += '\n';
        out_.append(size_t(indent_) * depth_, ' ');
    }
    void scalar(const std::string &text) {
        out_ += text;
        first_ = false;
    }

    int indent_;
    size_t depth_ = 0;
    bool first_ = true;
    std::string out_;
};

void put_budget(Writer &w, const Budget &b) {
    w.open('{');
    switch (b.kind) {
        case Budget::Kind::tokens:
            w.key("tokens");
            w.value(b.amount);
            break;
        case Budget::Kind::fraction:
            w.key("fraction");
            w.value(b.fraction);
            break;
        case Budget::Kind::bytes:
            w.key("bytes");
            w.value(b.amount);
            break;
    }
    w.close('}');
}

void put_rule(Writer &w, const RuleSpec &r) {
    if (r.policy) {
        w.key("policy");
        w.value(std::string(policy_name(*r.policy)));
    }
    if (r.budget) {
        w.key("budget");
        put_budget(w, *r.budget);
    }
    if (r.sinks) {
        w.key("sinks");
        w.value(uint64_t(*r.sinks));
    }
    if (r.recent) {
        w.key("recent");
        w.value(uint64_t(*r.recent));
    }
}

}  // namespace

const char *policy_name(Policy p) {
    switch (p) {
        case Policy::sinks_recent:
            return "sinks_recent";
        case Policy::quest:
            return "quest";
        case Policy::snapkv:
            return "snapkv";
        case Policy::h2o:
            return "h2o";
        case Policy::dense:
            return "dense";
    }
    return "unknown";
}

uint64_t budget_blocks(const Budget &b, uint64_t num_tokens, uint32_t block_tokens, uint64_t head_token_bytes) {
    check(block_tokens >= 1, SG_ERR_INVALID_ARGUMENT, "select: block_tokens must be >= 1");
    const uint64_t all = ceil_div(num_tokens, block_tokens);
    uint64_t blocks = 0;
    switch (b.kind) {
        case Budget::Kind::tokens:
            blocks = ceil_div(b.amount, block_tokens);
            break;
        case Budget::Kind::fraction:
            check(b.fraction > 0.0 && b.fraction <= 1.0, SG_ERR_INVALID_ARGUMENT,
                  "select: a fraction budget must be in (0, 1]");
            blocks = ceil_div(fraction_of(b.fraction, num_tokens), block_tokens);
            break;
        case Budget::Kind::bytes:
            check(head_token_bytes > 0, SG_ERR_INVALID_ARGUMENT,
                  "select: a bytes budget needs the request's head_token_bytes (> 0)");
            blocks = ceil_div(b.amount, saturating_mul(block_tokens, head_token_bytes));
            break;
    }
    return std::min(blocks, all);
}

// ---- Profile ----

Rule Profile::rule(uint32_t layer, uint32_t head) const {
    if (layer >= num_layers || head >= num_kv_heads)
        fail(SG_ERR_OUT_OF_RANGE, "profile: (layer " + std::to_string(layer) + ", head " + std::to_string(head) +
                                      ") is outside " + std::to_string(num_layers) + " layers x " +
                                      std::to_string(num_kv_heads) + " KV heads");
    const LayerSpec *ls = nullptr;
    const HeadSpec *hs = nullptr;
    for (const LayerSpec &l : layers)
        if (l.layer == layer) ls = &l;
    if (ls)
        for (const HeadSpec &h : ls->heads)
            if (h.head == head) hs = &h;
    return resolve(*this, ls, hs).rule;
}

void validate(const Profile &p) {
    check_version(p.version);
    if (p.model.empty()) bad("model", "must be a non-empty string");
    if (p.num_layers == 0) bad("num_layers", "must be >= 1");
    if (p.num_kv_heads == 0) bad("num_kv_heads", "must be >= 1");
    // Checking, resolving and selecting visit every (layer, head): the shape is bounded so that the
    // work a profile asks for stays proportional to something real, not to two declared integers.
    if (p.num_layers > kMaxLayers)
        bad("num_layers", "must be <= " + std::to_string(kMaxLayers) + ", got " + std::to_string(p.num_layers));
    if (p.num_kv_heads > kMaxKvHeads)
        bad("num_kv_heads", "must be <= " + std::to_string(kMaxKvHeads) + ", got " + std::to_string(p.num_kv_heads));
    if (uint64_t(p.num_layers) * p.num_kv_heads > kMaxStreams)
        bad("num_kv_heads", "num_layers x num_kv_heads must be <= " + std::to_string(kMaxStreams) + ", got " +
                                std::to_string(p.num_layers) + " x " + std::to_string(p.num_kv_heads));
    if (p.block_tokens == 0) bad("block_tokens", "must be >= 1");
    if (p.combine != kernels::Combine::max && p.combine != kernels::Combine::sum)
        bad("combine", std::to_string(int(p.combine)) + " is not max or sum");
    if (p.pool == 0 || p.pool % 2 == 0) bad("pool", "must be odd and >= 1, got " + std::to_string(p.pool));
    if (p.total_budget) check_budget(*p.total_budget, "total_budget");
    if (!p.defaults.policy) bad("defaults.policy", "missing");
    check_spec(p.defaults, "defaults");

    std::vector<int64_t> layer_at(p.num_layers, -1);
    for (size_t i = 0; i < p.layers.size(); ++i) {
        const LayerSpec &ls = p.layers[i];
        const std::string path = indexed("", "layers", i);
        if (ls.layer >= p.num_layers)
            bad(path + ".layer",
                "must be < num_layers (" + std::to_string(p.num_layers) + "), got " + std::to_string(ls.layer));
        if (layer_at[ls.layer] >= 0)
            bad(path + ".layer", "layer " + std::to_string(ls.layer) + " is already given in " +
                                     indexed("", "layers", size_t(layer_at[ls.layer])));
        layer_at[ls.layer] = int64_t(i);
        check_spec(ls.rule, path);
        std::vector<int64_t> head_at(p.num_kv_heads, -1);
        for (size_t j = 0; j < ls.heads.size(); ++j) {
            const HeadSpec &hs = ls.heads[j];
            const std::string hpath = indexed(path, "heads", j);
            if (hs.head >= p.num_kv_heads)
                bad(hpath + ".head",
                    "must be < num_kv_heads (" + std::to_string(p.num_kv_heads) + "), got " + std::to_string(hs.head));
            if (head_at[hs.head] >= 0)
                bad(hpath + ".head", "head " + std::to_string(hs.head) + " is already given in " +
                                         indexed(path, "heads", size_t(head_at[hs.head])));
            head_at[hs.head] = int64_t(j);
            check_spec(hs.rule, hpath);
        }
    }
    for_each_rule(p, [&](uint32_t, uint32_t, const Resolved &r, int64_t layer_entry, int64_t head_entry) {
        if (is_dense(r.rule) || r.has_budget) return;
        const std::string at = r.policy_level == 0 ? "defaults"
                               : r.policy_level == 1
                                   ? indexed("", "layers", size_t(layer_entry))
                                   : indexed(indexed("", "layers", size_t(layer_entry)), "heads", size_t(head_entry));
        bad(at + ".budget", std::string("missing: policy ") + policy_name(r.rule.policy) + " needs a budget");
    });
}

Profile parse_profile(std::string_view text) {
    if (text.size() > kMaxProfileBytes)
        fail(SG_ERR_INVALID_ARGUMENT, "profile: " + std::to_string(text.size()) +
                                          " bytes, more than the 64 MiB a profile may have (SG_PROFILE_MAX_BYTES)");
    // The JSON reader ends the input at a NUL byte and would ignore what follows; valid JSON text
    // holds none, so any NUL within len is refused.
    if (const void *nul = std::memchr(text.data(), '\0', text.size()))
        fail(SG_ERR_INVALID_ARGUMENT,
             "profile: byte " + std::to_string(static_cast<const char *>(nul) - text.data()) +
                 " is a NUL: only whitespace may follow the JSON value within len");
    // The schema's deepest value is a budget inside a head inside a layer entry (6 levels); its
    // largest object, the top level, has 10 fields.
    json_input::check<Json>(text, json_input::Limits{16, 16, SG_ERR_INVALID_ARGUMENT, "profile"});
    json_input::Dom<Json> dom;  // first, so it is freed last
    try {
        json_input::parse_into(text, dom);
    } catch (const Json::exception &e) {  // the check refused what this could throw: not expected
        fail(SG_ERR_INVALID_ARGUMENT, std::string("profile: not valid JSON: ") + e.what());
    }
    const Json &j = dom.value;
    if (!j.is_object())
        fail(SG_ERR_INVALID_ARGUMENT, std::string("profile: must be a JSON object, got ") + j.type_name());
    Profile p;
    // Version first: a newer file must be refused for its version, not for the fields it added.
    p.version = as_u32(required(j, "", "version"), "version");
    check_version(p.version);
    allow_only(j, "",
               {"version", "model", "num_layers", "num_kv_heads", "block_tokens", "combine", "pool", "total_budget",
                "defaults", "layers"});
    p.model = as_string(required(j, "", "model"), "model");
    p.num_layers = as_positive_u32(required(j, "", "num_layers"), "num_layers");
    p.num_kv_heads = as_positive_u32(required(j, "", "num_kv_heads"), "num_kv_heads");
    p.block_tokens = as_positive_u32(required(j, "", "block_tokens"), "block_tokens");
    if (const Json *v = find(j, "combine")) {
        const std::string c = as_string(*v, "combine");
        if (c == "max")
            p.combine = kernels::Combine::max;
        else if (c == "sum")
            p.combine = kernels::Combine::sum;
        else
            bad("combine", "must be \"max\" or \"sum\", got \"" + c + "\"");
    }
    if (const Json *v = find(j, "pool")) p.pool = as_u32(*v, "pool");
    if (const Json *v = find(j, "total_budget")) p.total_budget = as_budget(*v, "total_budget");

    const Json &d = required(j, "", "defaults");
    expect_object(d, "defaults");
    allow_only(d, "defaults", {"policy", "budget", "sinks", "recent"});
    p.defaults = as_rule(d, "defaults");

    if (const Json *v = find(j, "layers")) {
        for (size_t i = 0; i < as_array(*v, "layers").size(); ++i) {
            const Json &lj = (*v)[i];
            const std::string path = indexed("", "layers", i);
            expect_object(lj, path);
            allow_only(lj, path, {"layer", "policy", "budget", "sinks", "recent", "heads"});
            LayerSpec ls;
            ls.layer = as_u32(required(lj, path, "layer"), path + ".layer");
            ls.rule = as_rule(lj, path);
            if (const Json *hv = find(lj, "heads")) {
                for (size_t k = 0; k < as_array(*hv, path + ".heads").size(); ++k) {
                    const Json &hj = (*hv)[k];
                    const std::string hpath = indexed(path, "heads", k);
                    expect_object(hj, hpath);
                    allow_only(hj, hpath, {"head", "policy", "budget", "sinks", "recent"});
                    HeadSpec hs;
                    hs.head = as_u32(required(hj, hpath, "head"), hpath + ".head");
                    hs.rule = as_rule(hj, hpath);
                    ls.heads.push_back(std::move(hs));
                }
            }
            p.layers.push_back(std::move(ls));
        }
    }
    validate(p);
    return p;
}

Profile load_profile(const std::string &path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below as not regular).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) fail(SG_ERR_NOT_FOUND, "profile: cannot read " + path + ": " + std::strerror(errno));
    struct Closer {
        int fd;
        ~Closer() { ::close(fd); }
    } closer{fd};
    struct stat st;
    if (::fstat(fd, &st) != 0) fail(SG_ERR_NOT_FOUND, "profile: cannot read " + path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
        fail(SG_ERR_INVALID_ARGUMENT, "profile: " + path + " is not a regular file (a device, FIFO or directory)");
    if (uint64_t(st.st_size) > kMaxProfileBytes)
        fail(SG_ERR_INVALID_ARGUMENT, "profile: " + path + " has " + std::to_string(st.st_size) +
                                          " bytes, more than the 64 MiB a profile may have (SG_PROFILE_MAX_BYTES)");
    std::string text;
    text.reserve(size_t(st.st_size));
    char chunk[1 << 16];
    for (;;) {
        const ssize_t n = ::read(fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail(SG_ERR_NOT_FOUND, "profile: cannot read " + path + ": " + std::strerror(errno));
        if (n == 0) break;
        if (text.size() + size_t(n) > kMaxProfileBytes)  // it grew while being read
            fail(SG_ERR_INVALID_ARGUMENT, "profile: " + path + " has more than the 64 MiB a profile may have");
        text.append(chunk, size_t(n));
    }
    return parse_profile(text);
}

std::string to_json(const Profile &p, int indent) {
    Writer w(indent);
    w.open('{');
    w.key("version");
    w.value(uint64_t(p.version));
    w.key("model");
    w.value(p.model);
    w.key("num_layers");
    w.value(uint64_t(p.num_layers));
    w.key("num_kv_heads");
    w.value(uint64_t(p.num_kv_heads));
    w.key("block_tokens");
    w.value(uint64_t(p.block_tokens));
    w.key("combine");
    w.value(std::string(p.combine == kernels::Combine::sum ? "sum" : "max"));
    w.key("pool");
    w.value(uint64_t(p.pool));
    if (p.total_budget) {
        w.key("total_budget");
        put_budget(w, *p.total_budget);
    }
    w.key("defaults");
    w.open('{');
    put_rule(w, p.defaults);
    w.close('}');
    if (!p.layers.empty()) {
        w.key("layers");
        w.open('[');
        for (const LayerSpec &ls : p.layers) {
            w.element();
            w.open('{');
            w.key("layer");
            w.value(uint64_t(ls.layer));
            put_rule(w, ls.rule);
            if (!ls.heads.empty()) {
                w.key("heads");
                w.open('[');
                for (const HeadSpec &hs : ls.heads) {
                    w.element();
                    w.open('{');
                    w.key("head");
                    w.value(uint64_t(hs.head));
                    put_rule(w, hs.rule);
                    w.close('}');
                }
                w.close(']');
            }
            w.close('}');
        }
        w.close(']');
    }
    w.close('}');
    return w.take();
}

// ---- Selector ----

Selector::Selector(const Profile &profile, const Request &request)
    : num_layers_(profile.num_layers),
      num_kv_heads_(profile.num_kv_heads),
      block_tokens_(profile.block_tokens),
      num_tokens_(request.num_tokens),
      head_token_bytes_(request.head_token_bytes) {
    validate(profile);
    const uint64_t nb = num_blocks_ = kernels::num_blocks(num_tokens_, block_tokens_);
    check(nb <= UINT32_MAX, SG_ERR_INVALID_ARGUMENT, "select: the request has more blocks than a uint32_t counts");
    heads_.resize(size_t(num_layers_) * num_kv_heads_);
    for_each_rule(profile, [&](uint32_t l, uint32_t h, const Resolved &r, int64_t, int64_t) {
        Head &hd = heads_[size_t(l) * num_kv_heads_ + h];
        hd.rule = r.rule;
        if (is_dense(r.rule)) {
            hd.rule.budget = Budget{};
            hd.own = hd.budget = hd.forced = nb;
            hd.sink_end = hd.recent_from = nb;
            return;
        }
        hd.sink_end = std::min(nb, ceil_div(r.rule.sinks, block_tokens_));
        uint64_t recent_from = nb;
        if (r.rule.recent > 0)
            recent_from = r.rule.recent >= num_tokens_ ? 0 : (num_tokens_ - r.rule.recent) / block_tokens_;
        hd.recent_from = std::max(recent_from, hd.sink_end);
        hd.forced = hd.sink_end + (nb - hd.recent_from);
        hd.own = hd.budget = budget_blocks(r.rule.budget, num_tokens_, block_tokens_, head_token_bytes_);
    });
    if (!profile.total_budget) return;

    // The total is counted in blocks of one head of one layer ("units").
    const uint64_t streams = uint64_t(num_layers_) * num_kv_heads_;
    const Budget &t = *profile.total_budget;
    switch (t.kind) {
        case Budget::Kind::fraction:
            total_blocks_ = fraction_of(t.fraction, saturating_mul(nb, streams));
            break;
        case Budget::Kind::tokens:
            total_blocks_ = saturating_mul(ceil_div(t.amount, block_tokens_), streams);
            break;
        case Budget::Kind::bytes:
            check(head_token_bytes_ > 0, SG_ERR_INVALID_ARGUMENT,
                  "select: a bytes budget needs the request's head_token_bytes (> 0)");
            total_blocks_ = ceil_div(t.amount, saturating_mul(block_tokens_, head_token_bytes_));
            break;
    }
    uint64_t fixed = 0, flexible = 0;
    for (const Head &hd : heads_) {
        fixed += hd.forced;
        if (!is_dense(hd.rule)) flexible += std::max(hd.forced, hd.own) - hd.forced;
    }
    over_total_ = fixed > total_blocks_;
    if (flexible == 0 || fixed + flexible <= total_blocks_) return;

    // Share what is left after the fixed part in proportion to what each head's own budget asks
    // beyond its sinks and recent window; the units lost to rounding down go to the largest
    // remainders, ties to the lower (layer, head), so the split is deterministic.
    const uint64_t rest = total_blocks_ > fixed ? total_blocks_ - fixed : 0;
    uint64_t given = 0;
    std::vector<std::pair<uint64_t, size_t>> remainders;
    for (size_t i = 0; i < heads_.size(); ++i) {
        Head &hd = heads_[i];
        if (is_dense(hd.rule)) continue;
        const uint64_t want = std::max(hd.forced, hd.own) - hd.forced;
        const unsigned __int128 q = (unsigned __int128)want * rest;
        const uint64_t share = uint64_t(q / flexible);
        hd.budget = hd.forced + share;
        given += share;
        if (const uint64_t rem = uint64_t(q % flexible)) remainders.emplace_back(rem, i);
    }
    std::sort(remainders.begin(), remainders.end(), [](const auto &a, const auto &b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (size_t i = 0; i < rest - given && i < remainders.size(); ++i) heads_[remainders[i].second].budget++;
}

const Selector::Head &Selector::checked_head(uint32_t layer, uint32_t h) const {
    if (layer >= num_layers_ || h >= num_kv_heads_)
        fail(SG_ERR_OUT_OF_RANGE, "select: (layer " + std::to_string(layer) + ", head " + std::to_string(h) +
                                      ") is outside " + std::to_string(num_layers_) + " layers x " +
                                      std::to_string(num_kv_heads_) + " KV heads");
    return head(layer, h);
}

const Rule &Selector::rule(uint32_t layer, uint32_t h) const { return checked_head(layer, h).rule; }

uint64_t Selector::budget(uint32_t layer, uint32_t h) const { return checked_head(layer, h).budget; }

bool Selector::needs_scores(uint32_t layer) const {
    for (uint32_t h = 0; h < num_kv_heads_; ++h) {
        const Head &hd = checked_head(layer, h);
        const Policy p = hd.rule.policy;
        if ((p == Policy::quest || p == Policy::snapkv || p == Policy::h2o) && hd.budget > hd.forced &&
            hd.recent_from > hd.sink_end)
            return true;
    }
    return false;
}

void Selector::select_layer(uint32_t layer, std::span<const float> scores, LayerSelection &out) const {
    if (layer >= num_layers_)
        fail(SG_ERR_OUT_OF_RANGE,
             "select: layer " + std::to_string(layer) + " is outside " + std::to_string(num_layers_) + " layers");
    const uint64_t nb = num_blocks_;
    const uint32_t nh = num_kv_heads_;
    if ((!scores.empty() || needs_scores(layer)) && scores.size() != nb * nh)
        fail(SG_ERR_INVALID_ARGUMENT, "select: layer " + std::to_string(layer) + " needs " + std::to_string(nb * nh) +
                                          " scores ([block][kv_head]), got " + std::to_string(scores.size()));

    // Tokens in a sorted set of blocks: all full except a partial last block of the request.
    const uint64_t missing_in_last = nb * block_tokens_ - num_tokens_;
    const auto tokens_in = [&](const Vec<uint32_t> &set) {
        const uint64_t t = set.size() * uint64_t(block_tokens_);
        return !set.empty() && set.back() == nb - 1 ? t - missing_in_last : t;
    };

    LayerStats st;
    st.num_blocks = nb;
    out.heads.resize(nh);
    Vec<uint8_t> essential(nb, 0);
    Vec<float> column;
    Vec<uint32_t> candidates;
    for (uint32_t h = 0; h < nh; ++h) {
        const Head &hd = head(layer, h);
        Vec<uint32_t> &set = out.heads[h];
        set.clear();
        st.budget_blocks += hd.budget;
        if (is_dense(hd.rule)) {
            st.dense_heads++;
            set.resize(nb);
            std::iota(set.begin(), set.end(), 0u);
        } else {
            if (hd.forced > hd.own) st.over_budget_heads++;
            const uint64_t take = std::min(std::max(hd.budget, hd.forced), nb) - hd.forced;
            set.reserve(hd.forced + take);
            for (uint64_t b = 0; b < hd.sink_end; ++b) set.push_back(uint32_t(b));
            if (take > 0 && hd.rule.policy == Policy::sinks_recent) {
                // StreamingLLM has no scores: a larger budget widens the recent window.
                for (uint64_t b = hd.recent_from - take; b < hd.recent_from; ++b) set.push_back(uint32_t(b));
            } else if (take > 0) {
                const uint64_t m = hd.recent_from - hd.sink_end;
                column.resize(m);
                candidates.resize(m);
                for (uint64_t i = 0; i < m; ++i) column[i] = scores[(hd.sink_end + i) * nh + h];
                std::iota(candidates.begin(), candidates.end(), 0u);
                kernels::top_k(column, candidates, take);
                std::sort(candidates.begin(), candidates.begin() + take);
                for (uint64_t i = 0; i < take; ++i) set.push_back(uint32_t(hd.sink_end + candidates[i]));
            }
            for (uint64_t b = hd.recent_from; b < nb; ++b) set.push_back(uint32_t(b));
        }
        for (uint32_t b : set) essential[b] = 1;
        st.head_blocks += set.size();
        st.head_bytes += tokens_in(set) * head_token_bytes_;
    }
    out.blocks.clear();
    for (uint64_t b = 0; b < nb; ++b)
        if (essential[b]) out.blocks.push_back(uint32_t(b));
    st.union_blocks = out.blocks.size();
    st.union_bytes = tokens_in(out.blocks) * head_token_bytes_ * nh;
    st.extra_bytes = st.union_bytes - st.head_bytes;
    out.stats = st;
}

LayerSelection Selector::select_layer(uint32_t layer, std::span<const float> scores) const {
    LayerSelection out;
    select_layer(layer, scores, out);
    return out;
}

}  // namespace sg::select
