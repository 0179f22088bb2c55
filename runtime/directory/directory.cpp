#include "directory/directory.hpp"

#include "directory/json.hpp"

#include <curl/curl.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>

namespace sg::directory {

namespace {

constexpr size_t kMaxNameBytes = 200;
// An answer larger than this is refused at once (a list of 10,000 engines' names is ~1 MiB; a
// member that sends more is broken or hostile).
constexpr size_t kMaxResponseBytes = 16u << 20;

void curl_once() {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// One easy handle per thread: libcurl keeps its connections to the members open between requests.
// The handle and whether this thread's handles are gone are plain thread_locals, which live as long
// as the thread; the guard's destructor cleans up. At exit() the main thread's thread_locals are
// destroyed before the static ones, among them the API's registry of directory handles, whose
// destruction revokes the leases of handles the host never destroyed: that call must find the
// handle gone and fail, not reset a freed one (0.5: "double free" or SIGSEGV in exit() 13 of 13).
thread_local CURL *t_handle = nullptr;
thread_local bool t_handles_gone = false;

struct ThreadHandleGuard {
    ~ThreadHandleGuard() {
        if (t_handle) curl_easy_cleanup(t_handle);
        t_handle = nullptr;
        t_handles_gone = true;
    }
};

CURL *thread_handle() {
    if (t_handles_gone) fail(SG_ERR_INVALID_STATE, "the thread is ending: no more requests from it");
    if (!t_handle) {
        thread_local ThreadHandleGuard guard;
        (void)guard;
        curl_once();
        t_handle = curl_easy_init();
        if (!t_handle) fail(SG_ERR_NO_MEMORY, "curl_easy_init failed");
    }
    curl_easy_reset(t_handle);
    return t_handle;
}

struct Collected {
    std::string body;
    bool too_large = false;
};

size_t collect(char *data, size_t size, size_t n, void *user) {
    auto *out = static_cast<Collected *>(user);
    if (out->body.size() + size * n > kMaxResponseBytes) {
        out->too_large = true;
        return 0;  // aborts the transfer
    }
    out->body.append(data, size * n);
    return size * n;
}

// Failures that say the member is not there for us at all (nothing listens, no such host, TLS
// spoken to a plain member or the reverse, a URL curl cannot use): trying it again within this
// call cannot help, so once every member failed so the call fails at once. Timeouts and broken
// answers may be an election in progress and are retried until the deadline.
bool member_absent(CURLcode rc) {
    switch (rc) {
        case CURLE_COULDNT_CONNECT:
        case CURLE_COULDNT_RESOLVE_HOST:
        case CURLE_UNSUPPORTED_PROTOCOL:
        case CURLE_URL_MALFORMAT:
        case CURLE_SSL_CONNECT_ERROR:
        case CURLE_PEER_FAILED_VERIFICATION:
        case CURLE_SSL_CERTPROBLEM:
        case CURLE_SSL_CIPHER:
        case CURLE_SSL_CACERT_BADFILE:
        case CURLE_USE_SSL_FAILED:
        case CURLE_SSL_ENGINE_INITFAILED:
            return true;
        default:
            return false;
    }
}

std::string b64(std::string_view s) { return json::quote(json::base64_encode(s)); }

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
    while (!prefix.empty()) {
        if (uint8_t(prefix.back()) < 0xff) {
            prefix.back() = char(uint8_t(prefix.back()) + 1);
            return prefix;
        }
        prefix.pop_back();
    }
    return std::string(1, '\0');  // every key
}

std::string trim(const std::string &s) {
    const size_t a = s.find_first_not_of(" \t");
    const size_t b = s.find_last_not_of(" \t");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::unique_ptr<json::Document> parse_or_fail(const std::string &body, const char *what) {
    std::string why;
    auto doc = json::parse(body, &why, kMaxResponseBytes);
    if (!doc || !doc->root().is_object())
        fail(SG_ERR_PROTOCOL, std::string("etcd's answer to ") + what + " is not a JSON object" + (why.empty() ? "" : ": ") + why);
    return doc;
}

int64_t header_revision(const json::Value &v) {
    const json::Value *h = json::get(v, "header");
    const json::Value *r = h ? json::get(*h, "revision") : nullptr;
    const auto rev = r ? json::as_int(*r) : std::nullopt;
    if (!rev) fail(SG_ERR_PROTOCOL, "etcd's answer has no header revision");
    return *rev;
}

// The decoded kvs of a range answer: (key, value).
std::vector<std::pair<std::string, std::string>> kvs_of(const json::Value &v) {
    std::vector<std::pair<std::string, std::string>> out;
    const json::Value *kvs = json::get(v, "kvs");
    if (!kvs) return out;
    if (!kvs->is_array()) fail(SG_ERR_PROTOCOL, "etcd's kvs is not an array");
    for (const json::Value &kv : *kvs) {
        const json::Value *k = json::get(kv, "key");
        const json::Value *val = json::get(kv, "value");
        const std::string *ks = k ? json::as_string(*k) : nullptr;
        const std::string *vs = val ? json::as_string(*val) : nullptr;
        auto key = ks ? json::base64_decode(*ks) : std::nullopt;
        auto value = vs ? json::base64_decode(*vs) : val ? std::nullopt : std::optional<std::string>("");
        if (!key || !value) fail(SG_ERR_PROTOCOL, "etcd's kvs holds a key or value that is not base64");
        out.emplace_back(std::move(*key), std::move(*value));
    }
    return out;
}

// Appends "member: what" to a call's list of failures.
void note(std::string &errors, const std::string &member, const std::string &what) {
    if (!errors.empty()) errors += "; ";
    errors += member;
    errors += ": ";
    errors += what;
}

}  // namespace

std::vector<std::string> parse_endpoints(const std::string &list) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= list.size()) {
        size_t comma = list.find(',', start);
        if (comma == std::string::npos) comma = list.size();
        std::string e = trim(list.substr(start, comma - start));
        start = comma + 1;
        if (e.empty()) {
            if (comma == list.size() && !out.empty()) break;
            fail(SG_ERR_INVALID_ARGUMENT, "endpoints: an empty entry in \"" + list + "\"");
        }
        if (e.find("://") == std::string::npos) e = "http://" + e;
        if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0)
            fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\" is not an http:// or https:// URL");
        const size_t host_at = e.find("://") + 3;
        while (e.size() > host_at && e.back() == '/') e.pop_back();
        const std::string host = e.substr(host_at);
        if (host.empty() || host.find_first_of(" /?#@") != std::string::npos)
            fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\" is not scheme://host:port");
        // host is a name, an IPv4 address or a bracketed IPv6 one, then an optional :port in 1..65535.
        size_t port_at = std::string::npos;
        if (host[0] == '[') {
            const size_t close = host.find(']');
            if (close == std::string::npos || close == 1)
                fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\" has an unclosed or empty [IPv6] host");
            if (close + 1 < host.size()) {
                if (host[close + 1] != ':')
                    fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\": only :port may follow the [IPv6] host");
                port_at = close + 2;
            }
        } else {
            const size_t colon = host.find(':');
            if (colon == 0) fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\" has no host");
            if (colon != std::string::npos) {
                if (host.find(':', colon + 1) != std::string::npos)
                    fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\": an IPv6 host goes in brackets");
                port_at = colon + 1;
            }
        }
        if (port_at != std::string::npos) {
            const std::string port = host.substr(port_at);
            if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
                std::stoul(port) == 0 || std::stoul(port) > 65535)
                fail(SG_ERR_INVALID_ARGUMENT, "endpoints: \"" + e + "\": the port must be 1..65535");
        }
        out.push_back(e);
    }
    if (out.empty()) fail(SG_ERR_INVALID_ARGUMENT, "endpoints: none given");
    return out;
}

void check_name(const std::string &name) {
    if (name.empty() || name.size() > kMaxNameBytes)
        fail(SG_ERR_INVALID_ARGUMENT, "a directory name has 1 to " + std::to_string(kMaxNameBytes) + " bytes");
    for (const char c : name)
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-' || c == '/'))
            fail(SG_ERR_INVALID_ARGUMENT, "directory name \"" + name + "\": only letters, digits, '.', '_', '-' and '/'");
    if (name.front() == '/' || name.back() == '/' || name.find("//") != std::string::npos)
        fail(SG_ERR_INVALID_ARGUMENT, "directory name \"" + name + "\": '/' only between parts");
}

struct Client::Response {
    long http = 0;
    std::string body;
};

Client::Client(Options options)
    : options_(std::move(options)),
      keepalive_(std::chrono::milliseconds(std::max<uint32_t>(200, options_.lease_ttl_ms / 3)),
                 // Up to two thirds of the TTL for a round: on a loaded host a late answer still
                 // counts, and one more try fits before the lease would end.
                 std::chrono::milliseconds(options_.lease_ttl_ms * 2 / 3),
                 [this](uint64_t deadline_ns) { keepalive_round(deadline_ns); }) {
    if (options_.endpoints.empty()) fail(SG_ERR_INVALID_ARGUMENT, "endpoints: none given");
    if (options_.prefix.empty()) options_.prefix = "/smartgen/";
    if (options_.prefix.back() != '/') options_.prefix += '/';
    if (options_.lease_ttl_ms < 1000 || options_.lease_ttl_ms > 3600000)
        fail(SG_ERR_INVALID_ARGUMENT, "lease_ttl_ms must be 1000..3600000");
    if (!options_.request_timeout_ms) options_.request_timeout_ms = 1000;
    curl_once();
}

Client::~Client() {
    keepalive_.stop();
    if (lease_) {
        // Everything this client wrote goes at once, not when the TTL runs out. Best effort: an
        // unreachable cluster ends the lease by its TTL instead.
        try {
            call("/v3/lease/revoke", "{\"ID\":" + std::to_string(lease_) + "}",
                 now_ns() + uint64_t(options_.request_timeout_ms) * 1000000);
        } catch (...) {
        }
    }
}

Client::Response Client::call(const std::string &path, const std::string &body, uint64_t deadline_ns) {
    const size_t n = options_.endpoints.size();
    size_t first;
    {
        std::lock_guard lock(mu_);
        first = preferred_;
    }
    std::string errors;
    // Members that refuse the connection are down: when all are, the call fails at once. A member
    // that times out or answers 5xx may be in an election (a leader just died): then the members
    // are tried again, round after round, until the deadline.
    bool retryable = false;
    std::string last_round;
    // A deadline already passed when the call starts (timeout 0) polls: each member at most once,
    // within the request timeout, and no further round.
    const bool poll = now_ns() >= deadline_ns;
    for (size_t tried = 0;; ++tried) {
        if (tried && tried % n == 0) {
            if (!retryable || poll) break;
            retryable = false;
            last_round = std::move(errors);
            errors.clear();
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        const size_t idx = (first + tried) % n;
        const uint64_t now = now_ns();
        if (now >= deadline_ns && !(poll && tried < n)) {
            std::string why = "the directory's deadline passed (";
            why += !errors.empty() ? errors : !last_round.empty() ? last_round : std::string("no answer yet");
            why += ')';
            fail(SG_ERR_TIMEOUT, why);
        }
        const uint64_t budget_ms =
            now >= deadline_ns
                ? options_.request_timeout_ms
                : std::max<uint64_t>(1, std::min<uint64_t>((deadline_ns - now) / 1000000, options_.request_timeout_ms));
        CURL *h = thread_handle();
        const std::string url = options_.endpoints[idx] + path;
        Response r;
        curl_easy_setopt(h, CURLOPT_URL, url.c_str());
        curl_easy_setopt(h, CURLOPT_POST, 1L);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, long(body.size()));
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, long(budget_ms));
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, long(budget_ms));
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect);
        Collected got;
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &got);
        requests_++;
        const CURLcode rc = curl_easy_perform(h);
        if (tried) failovers_++;
        if (got.too_large) {
            got = Collected{};
#ifdef __GLIBC__
            malloc_trim(0);  // the partial answer's pages go back now, not at some later free
#endif
            fail(SG_ERR_PROTOCOL, "etcd " + options_.endpoints[idx] + path + ": the answer is larger than " +
                                      std::to_string(kMaxResponseBytes >> 20) + " MiB; refused");
        }
        r.body = std::move(got.body);
        if (rc != CURLE_OK) {
            note(errors, options_.endpoints[idx], curl_easy_strerror(rc));
            retryable = retryable || !member_absent(rc);
            continue;
        }
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.http);
        if (r.http >= 500) {  // a member without a leader or quorum: another may have one
            retryable = true;
            note(errors, options_.endpoints[idx], "HTTP " + std::to_string(r.http) + " " + r.body.substr(0, 200));
            continue;
        }
        {
            std::lock_guard lock(mu_);
            preferred_ = idx;
        }
        if (r.http != 200) {
            auto doc = json::parse(r.body, nullptr, kMaxResponseBytes);
            const json::Value *m = doc ? json::get(doc->root(), "message") : nullptr;
            if (!m && doc) m = json::get(doc->root(), "error");
            const std::string *text = m ? json::as_string(*m) : nullptr;
            fail(SG_ERR_REMOTE, "etcd " + options_.endpoints[idx] + path + ": HTTP " + std::to_string(r.http) + ": " +
                                    (text ? *text : r.body.substr(0, 200)));
        }
        return r;
    }
    fail(SG_ERR_CONNECT, "no etcd member answered: " + errors);
}

void Client::ping(uint64_t deadline_ns) {
    const Response r = call("/v3/maintenance/status", "{}", deadline_ns);
    (void)header_revision(parse_or_fail(r.body, "status")->root());
}

int64_t Client::ensure_lease(uint64_t deadline_ns) {
    {
        std::lock_guard lock(mu_);
        if (lease_) return lease_;
    }
    const int64_t ttl_s = int64_t((options_.lease_ttl_ms + 999) / 1000);
    const Response r = call("/v3/lease/grant", "{\"TTL\":" + std::to_string(ttl_s) + ",\"ID\":0}", deadline_ns);
    const auto doc = parse_or_fail(r.body, "lease grant");
    const json::Value *id = json::get(doc->root(), "ID");
    const auto lease = id ? json::as_int(*id) : std::nullopt;
    if (!lease || *lease <= 0) fail(SG_ERR_PROTOCOL, "etcd granted a lease without an ID");
    leases_granted_++;
    std::lock_guard lock(mu_);
    if (lease_) {  // another thread granted one meanwhile: ours expires unused
        return lease_;
    }
    lease_ = *lease;
    keepalive_.start();
    return lease_;
}

bool Client::keepalive_once(uint64_t deadline_ns) {
    int64_t lease;
    {
        std::lock_guard lock(mu_);
        lease = lease_;
    }
    if (!lease) return true;
    const Response r = call("/v3/lease/keepalive", "{\"ID\":" + std::to_string(lease) + "}", deadline_ns);
    // One answer a line ({"result": {...}}); a lease that ended answers TTL 0 or none.
    const std::string first = r.body.substr(0, r.body.find('\n'));
    const auto doc = parse_or_fail(first, "lease keep-alive");
    const json::Value *res = json::get(doc->root(), "result");
    const json::Value *ttl = res ? json::get(*res, "TTL") : nullptr;
    const auto t = ttl ? json::as_int(*ttl) : std::nullopt;
    if (t && *t > 0) {
        keepalives_++;
        return true;
    }
    return false;
}

void Client::keepalive_round(uint64_t deadline_ns) {
    if (!keepalive_once(deadline_ns)) {
        // The lease ended (the cluster was out of reach for longer than the TTL): a new one, and
        // every published name again.
        std::lock_guard lock(mu_);
        lease_ = 0;
    }
    check_names(deadline_ns);
}

void Client::publish(const std::string &name, std::span<const uint8_t> blob, uint64_t deadline_ns,
                     const MayReplace &may_replace) {
    check_name(name);
    const std::string key = options_.prefix + "engines/" + name;
    int64_t seen = 0;  // absent
    for (;;) {
        const auto held = put_if(key, blob, seen, deadline_ns);
        if (!held) break;
        const int64_t ours = ensure_lease(deadline_ns);
        if (held->lease != ours &&
            !may_replace(std::span(reinterpret_cast<const uint8_t *>(held->value.data()), held->value.size())))
            fail(SG_ERR_AUTH_FAILED, "\"" + name + "\" is held by another engine whose entry does not verify under this "
                                     "context's key (etcd lease " + std::to_string(held->lease) +
                                     "); it can be published here once that engine unpublishes it or its lease ends");
        seen = held->mod_revision;  // replace exactly what was read; a change meanwhile is read again
    }
    std::lock_guard lock(mu_);
    published_[key].assign(blob.begin(), blob.end());
    taken_.erase(key);
}

void Client::unpublish(const std::string &name, uint64_t deadline_ns) {
    check_name(name);
    const std::string key = options_.prefix + "engines/" + name;
    int64_t lease;
    {
        std::lock_guard lock(mu_);
        if (!published_.erase(key)) fail(SG_ERR_NOT_FOUND, "\"" + name + "\" is not published by this directory handle");
        taken_.erase(key);
        lease = lease_;
    }
    // Only this handle's entry: one another handle took over stays.
    const auto held = holder(key, deadline_ns);
    if (!held || held->lease != lease) return;
    call("/v3/kv/txn",
         "{\"compare\":[{\"key\":" + b64(key) + ",\"target\":\"MOD\",\"result\":\"EQUAL\",\"mod_revision\":" +
             std::to_string(held->mod_revision) + "}],\"success\":[{\"request_delete_range\":{\"key\":" + b64(key) +
             "}}]}",
         deadline_ns);
}

namespace {
int64_t int_field(const json::Value &v, const char *name) {
    const json::Value *f = json::get(v, name);
    const auto i = f ? json::as_int(*f) : std::nullopt;
    return i ? *i : 0;  // etcd leaves zero values out
}
}  // namespace

std::optional<Client::Held> Client::holder(const std::string &key, uint64_t deadline_ns) {
    const Response r = call("/v3/kv/range", "{\"key\":" + b64(key) + "}", deadline_ns);
    const auto doc = parse_or_fail(r.body, "range");
    const json::Value &v = doc->root();
    const json::Value *kvs = json::get(v, "kvs");
    if (!kvs || !kvs->is_array() || kvs->empty()) return std::nullopt;
    const json::Value &kv = (*kvs)[0];
    Held h;
    h.lease = int_field(kv, "lease");
    h.mod_revision = int_field(kv, "mod_revision");
    h.value = kvs_of(v)[0].second;
    if (h.mod_revision <= 0) fail(SG_ERR_PROTOCOL, "etcd's range answer has no mod_revision");
    return h;
}

std::optional<Client::Held> Client::put_if(const std::string &key, std::span<const uint8_t> blob, int64_t mod_revision,
                                           uint64_t deadline_ns) {
    const std::string value = b64(std::string_view(reinterpret_cast<const char *>(blob.data()), blob.size()));
    for (int attempt = 0;; ++attempt) {
        const int64_t lease = ensure_lease(deadline_ns);
        const std::string compare = mod_revision ? "{\"key\":" + b64(key) +
                                                       ",\"target\":\"MOD\",\"result\":\"EQUAL\",\"mod_revision\":" +
                                                       std::to_string(mod_revision) + "}"
                                                 : "{\"key\":" + b64(key) +
                                                       ",\"target\":\"CREATE\",\"result\":\"EQUAL\",\"create_revision\":0}";
        Response r;
        try {
            r = call("/v3/kv/txn",
                     "{\"compare\":[" + compare + "],\"success\":[{\"request_put\":{\"key\":" + b64(key) +
                         ",\"value\":" + value + ",\"lease\":" + std::to_string(lease) +
                         "}}],\"failure\":[{\"request_range\":{\"key\":" + b64(key) + "}}]}",
                     deadline_ns);
        } catch (const Error &e) {
            // The lease ended before the keep-alive thread noticed: a new one, once (put_with_lease).
            if (attempt || e.status() != SG_ERR_REMOTE || e.message().find("lease not found") == std::string::npos)
                throw;
            std::lock_guard lock(mu_);
            if (lease_ == lease) lease_ = 0;
            continue;
        }
        const auto doc = parse_or_fail(r.body, "txn");
        const json::Value &v = doc->root();
        if (json::is_true(json::get(v, "succeeded"))) return std::nullopt;
        // The failure branch's range: who holds the key now (gone again meanwhile: try to create it).
        const json::Value *resps = json::get(v, "responses");
        const json::Value *range =
            resps && resps->is_array() && !resps->empty() ? json::get((*resps)[0], "response_range") : nullptr;
        if (!range) fail(SG_ERR_PROTOCOL, "etcd's failed transaction carries no range answer");
        const json::Value *kvs = json::get(*range, "kvs");
        if (!kvs || !kvs->is_array() || kvs->empty()) {
            if (!mod_revision) fail(SG_ERR_PROTOCOL, "etcd refused to create a key it says is absent");
            mod_revision = 0;
            continue;
        }
        Held h;
        h.lease = int_field((*kvs)[0], "lease");
        h.mod_revision = int_field((*kvs)[0], "mod_revision");
        h.value = kvs_of(*range)[0].second;
        if (h.mod_revision <= 0) fail(SG_ERR_PROTOCOL, "etcd's range answer has no mod_revision");
        return h;
    }
}

// Each keep-alive period: every published name is read back. Gone (deleted by hand, or a lease that
// ended): written again. Held under another lease: counted once, left alone, and written again when
// it is free, so the name is never lost while this handle lives and never fought over.
void Client::check_names(uint64_t deadline_ns) {
    std::map<std::string, std::vector<uint8_t>> names;
    {
        std::lock_guard lock(mu_);
        names = published_;
    }
    if (names.empty()) return;
    const int64_t ours = ensure_lease(deadline_ns);
    for (auto &[key, blob] : names) {
        auto held = holder(key, deadline_ns);
        if (held && held->lease == ours) {
            std::lock_guard lock(mu_);
            taken_.erase(key);
            continue;
        }
        if (!held) held = put_if(key, blob, 0, deadline_ns);
        std::lock_guard lock(mu_);
        if (!published_.count(key)) continue;  // unpublished meanwhile
        if (held) {
            if (taken_.insert(key).second) names_taken_over_++;
        } else {
            taken_.erase(key);
            names_restored_++;
        }
    }
}

std::optional<std::vector<uint8_t>> Client::lookup(const std::string &name, uint64_t deadline_ns) {
    check_name(name);
    const Response r = call("/v3/kv/range", "{\"key\":" + b64(options_.prefix + "engines/" + name) + "}", deadline_ns);
    auto kvs = kvs_of(parse_or_fail(r.body, "range")->root());
    if (kvs.empty()) return std::nullopt;
    return std::vector<uint8_t>(kvs[0].second.begin(), kvs[0].second.end());
}

std::vector<std::string> Client::list(const std::string &name_prefix, uint64_t deadline_ns) {
    const std::string base = options_.prefix + "engines/";
    const std::string from = base + name_prefix;
    const Response r = call("/v3/kv/range",
                            "{\"key\":" + b64(from) + ",\"range_end\":" + b64(prefix_end(from)) + ",\"keys_only\":true}",
                            deadline_ns);
    std::vector<std::string> names;
    for (auto &[key, value] : kvs_of(parse_or_fail(r.body, "range")->root()))
        if (key.size() > base.size() && key.compare(0, base.size(), base) == 0) names.push_back(key.substr(base.size()));
    std::sort(names.begin(), names.end());
    return names;
}

bool Client::wait(const std::string &name, bool present, uint64_t deadline_ns) {
    check_name(name);
    const std::string key = options_.prefix + "engines/" + name;
    for (;;) {
        const Response r = call("/v3/kv/range", "{\"key\":" + b64(key) + ",\"keys_only\":true}", deadline_ns);
        const auto doc = parse_or_fail(r.body, "range");
        const json::Value &v = doc->root();
        if (kvs_of(v).empty() != present) return true;
        if (now_ns() >= deadline_ns || interrupted_) return false;
        if (watch_once(key, "", header_revision(v) + 1, present, !present, deadline_ns)) return true;
        if (now_ns() >= deadline_ns) return false;
    }
}

void Client::request(const std::string &name, const std::string &from, std::span<const uint8_t> blob,
                     uint64_t deadline_ns) {
    check_name(name);
    put_with_lease(options_.prefix + "inbox/" + name + "/" + from, blob, deadline_ns);
}

void Client::put_with_lease(const std::string &key, std::span<const uint8_t> blob, uint64_t deadline_ns) {
    const std::string value = b64(std::string_view(reinterpret_cast<const char *>(blob.data()), blob.size()));
    for (int attempt = 0;; ++attempt) {
        const int64_t lease = ensure_lease(deadline_ns);
        try {
            call("/v3/kv/put", "{\"key\":" + b64(key) + ",\"value\":" + value + ",\"lease\":" + std::to_string(lease) + "}",
                 deadline_ns);
            return;
        } catch (const Error &e) {
            // The lease ended before the keep-alive thread noticed (the cluster was away longer
            // than the TTL): a new one, once.
            if (attempt || e.status() != SG_ERR_REMOTE || e.message().find("lease not found") == std::string::npos)
                throw;
            std::lock_guard lock(mu_);
            if (lease_ == lease) lease_ = 0;
        }
    }
}

std::optional<InboxEntry> Client::take_request(const std::string &name, uint64_t deadline_ns) {
    check_name(name);
    const std::string dir = options_.prefix + "inbox/" + name + "/";
    for (;;) {
        // The deadline bounds the wait for a request, not the calls that take one: a request found
        // just before it must not be deleted by a call that then times out, and so be lost.
        const uint64_t call_deadline = std::max(deadline_ns, now_ns() + uint64_t(options_.request_timeout_ms) * 1000000);
        // Oldest first: the request that has waited longest.
        const Response r = call("/v3/kv/range",
                                "{\"key\":" + b64(dir) + ",\"range_end\":" + b64(prefix_end(dir)) +
                                    ",\"sort_order\":\"ASCEND\",\"sort_target\":\"CREATE\",\"limit\":1}",
                                call_deadline);
        const auto doc = parse_or_fail(r.body, "range");
        const json::Value &v = doc->root();
        auto kvs = kvs_of(v);
        if (!kvs.empty()) {
            // Whoever deletes it takes it: two takers of one inbox never get the same request.
            const Response d = call("/v3/kv/deleterange", "{\"key\":" + b64(kvs[0].first) + "}",
                                    now_ns() + uint64_t(options_.request_timeout_ms) * 1000000);
            const auto answer = parse_or_fail(d.body, "deleterange");
            const json::Value *deleted = json::get(answer->root(), "deleted");
            if (deleted && json::as_int(*deleted).value_or(0) > 0)
                return InboxEntry{kvs[0].first.substr(dir.size()),
                                  std::vector<uint8_t>(kvs[0].second.begin(), kvs[0].second.end())};
            continue;
        }
        if (now_ns() >= deadline_ns || interrupted_) return std::nullopt;
        watch_once(dir, prefix_end(dir), header_revision(v) + 1, true, false, deadline_ns);
        if (now_ns() >= deadline_ns || interrupted_) return std::nullopt;
    }
}

namespace {

// The watch stream's state: answers arrive as JSON objects, one a line.
struct WatchState {
    const std::atomic<bool> *interrupted = nullptr;
    std::string buffer;
    bool want_put = false, want_delete = false;
    bool matched = false;
    bool canceled = false;
};

size_t on_watch_bytes(char *data, size_t size, size_t n, void *user) {
    auto *w = static_cast<WatchState *>(user);
    w->buffer.append(data, size * n);
    if (w->buffer.size() > kMaxResponseBytes) return 0;
    size_t nl;
    while ((nl = w->buffer.find('\n')) != std::string::npos) {
        const std::string line = w->buffer.substr(0, nl);
        w->buffer.erase(0, nl + 1);
        auto doc = json::parse(line, nullptr, kMaxResponseBytes);
        const json::Value *res = doc ? json::get(doc->root(), "result") : nullptr;
        if (!res) continue;
        if (json::is_true(json::get(*res, "canceled"))) {
            w->canceled = true;  // compacted past our revision, say: the caller reads the state again
            return 0;
        }
        const json::Value *events = json::get(*res, "events");
        if (!events || !events->is_array()) continue;
        for (const json::Value &e : *events) {
            const json::Value *type = json::get(e, "type");
            const std::string *t = type ? json::as_string(*type) : nullptr;
            const bool is_delete = t && *t == "DELETE";
            if ((is_delete && w->want_delete) || (!is_delete && w->want_put)) {
                w->matched = true;
                return 0;  // stops the stream: curl_easy_perform returns CURLE_WRITE_ERROR
            }
        }
    }
    return size * n;
}

// libcurl's progress callback, called about once a second and on every chunk: a non-zero answer
// aborts the transfer, so an interrupt ends an idle watch at once.
int on_watch_progress(void *user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
    return static_cast<WatchState *>(user)->interrupted->load() ? 1 : 0;
}

}  // namespace

void Client::interrupt() { interrupted_ = true; }

bool Client::watch_once(const std::string &key, const std::string &range_end, int64_t start_revision, bool want_put,
                        bool want_delete, uint64_t deadline_ns) {
    size_t idx;
    {
        std::lock_guard lock(mu_);
        idx = preferred_;
    }
    const uint64_t now = now_ns();
    if (now >= deadline_ns) return false;
    std::string body = "{\"create_request\":{\"key\":" + b64(key);
    if (!range_end.empty()) body += ",\"range_end\":" + b64(range_end);
    body += ",\"start_revision\":" + std::to_string(start_revision) + "}}";
    CURL *h = curl_easy_init();
    if (!h) fail(SG_ERR_NO_MEMORY, "curl_easy_init failed");
    WatchState w;
    w.interrupted = &interrupted_;
    w.want_put = want_put;
    w.want_delete = want_delete;
    const std::string url = options_.endpoints[idx] + "/v3/watch";
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, long(body.size()));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, long(std::max<uint64_t>(1, (deadline_ns - now) / 1000000)));
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, long(options_.request_timeout_ms));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_watch_bytes);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &w);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_watch_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, &w);
    requests_++;
    const CURLcode rc = curl_easy_perform(h);
    curl_easy_cleanup(h);
    if (w.matched) return true;
    if (interrupted_) return false;
    if (rc != CURLE_OK && rc != CURLE_OPERATION_TIMEDOUT && !w.canceled) {
        // This member went away mid-watch: the next read goes to another one.
        std::lock_guard lock(mu_);
        if (preferred_ == idx) preferred_ = (idx + 1) % options_.endpoints.size();
        failovers_++;
        // A refused connection returns at once: do not spin on it.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
}

Stats Client::stats() const {
    Stats s;
    s.requests = requests_.load();
    s.failovers = failovers_.load();
    s.keepalives = keepalives_.load();
    s.leases_granted = leases_granted_.load();
    s.names_taken_over = names_taken_over_.load();
    s.names_restored = names_restored_.load();
    s.keepalive_failures = keepalive_.failures();
    return s;
}

}  // namespace sg::directory
