// The C ABI: the cluster directory (docs/directory.md), in a library built with it
// (SMARTGEN_DIRECTORY=ON; directory_off.cpp otherwise).
#include "abi.hpp"

using namespace sg::abi;
using sg::Error;
using sg::fail;

namespace {

// A directory handle: the etcd client, the inbox of its published name (a runtime thread that
// answers each session request the moment it arrives) and the sessions it made, kept for
// sg_directory_accept.
struct DirectoryObj {
    uint64_t ctx_handle = 0;  // 0: lookups only
    std::unique_ptr<sg::directory::Client> client;
    sg::directory::Inbox inbox{[this](const std::string &name, uint64_t deadline) { return client->take_request(name, deadline); },
                               [this] {
                                   if (client) client->interrupt();  // none when the open failed
                               },
                               [this](const sg::directory::InboxEntry &req) { answer(req); }};
    std::mutex mu;
    std::condition_variable cv;
    std::deque<sg_session_t> accepted;
    bool stopping = false;
    std::atomic<uint64_t> sessions_accepted{0}, requests_refused{0};

    ~DirectoryObj() {
        {
            std::lock_guard lock(mu);
            stopping = true;
        }
        cv.notify_all();
        inbox.stop();
        client.reset();  // revokes the lease: the names go at once
    }

    void answer(const sg::directory::InboxEntry &req) {
        auto ctx = contexts().get(ctx_handle);
        if (!ctx) return;
        try {
            sg::wire::Hello peer = counting_auth_failures(*ctx, [&] { return core::parse_metadata(*ctx, req.blob); });
            sg_session_t s = add_session(*ctx, peer, nullptr, false);
            std::lock_guard lock(mu);
            accepted.push_back(s);
            sessions_accepted++;
            cv.notify_all();
        } catch (const sg::Error &e) {
            // Unsigned, signed with another key, corrupt, or a peer we already have a session with.
            requests_refused++;
            ctx->log.log(SG_LOG_WARN, "directory: a session request from " + req.from + " was refused: " + e.message());
        }
    }
};

core::Registry<DirectoryObj> &directories() {
    static core::Registry<DirectoryObj> r(8);
    return r;
}

uint64_t deadline_after(uint64_t timeout_ns) {
    const uint64_t now = sg::now_ns();
    return timeout_ns > UINT64_MAX - now ? UINT64_MAX : now + timeout_ns;
}

std::string name_arg(const char *name) {
    need(name, "name");
    std::string n(name);
    sg::directory::check_name(n);
    return n;
}

std::shared_ptr<core::Context> directory_context(const DirectoryObj &d) {
    if (!d.ctx_handle) fail(SG_ERR_INVALID_STATE, "this directory handle was opened without a context");
    return lookup(contexts(), d.ctx_handle, "the directory's context");
}

}  // namespace

void sg::abi::destroy_directories_of(uint64_t ctx_handle) {
    // Each handle's destructor revokes its lease, which withdraws its names at once.
    directories().remove_if([ctx_handle](const DirectoryObj &d) { return d.ctx_handle == ctx_handle; });
}


SG_API sg_status_t sg_directory_open(sg_context_t ctx, const sg_directory_options_t *options, sg_directory_t *out,
                                     sg_error_info_t *err) {
    return guard(err, [&] {
        need(out, "out");
        need(options, "options");
        const sg_directory_options_t o = read_sized(options, default_directory_options(), "options");
        if (ctx) (void)lookup(contexts(), raw(ctx), "context");
        if (!o.endpoints) fail(SG_ERR_INVALID_ARGUMENT, "options.endpoints is required");
        sg::directory::Options d;
        d.endpoints = sg::directory::parse_endpoints(o.endpoints);
        if (o.prefix) d.prefix = o.prefix;
        d.lease_ttl_ms = o.lease_ttl_ms ? o.lease_ttl_ms : 5000;
        d.request_timeout_ms = o.request_timeout_ms ? o.request_timeout_ms : 1000;
        auto obj = std::make_shared<DirectoryObj>();
        obj->ctx_handle = ctx ? raw(ctx) : 0;
        obj->client = std::make_unique<sg::directory::Client>(std::move(d));
        // The cluster is there now: one member answered within twice the request timeout, however
        // many members are listed (members that refuse connections are passed at once).
        obj->client->ping(deadline_after(2ull * obj->client->options().request_timeout_ms * 1000000ull));
        *out = wrap<sg_directory_t>(directories().add(std::move(obj)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_publish(sg_directory_t h, const char *name, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        const std::string n = name_arg(name);
        auto ctx = directory_context(*d);
        // An entry under the name that verifies under this context's key is this fleet's (a restarted
        // engine taking its name back); one that does not is another key's, and stays.
        const auto same_key = [&ctx](std::span<const uint8_t> held) {
            try {
                (void)core::parse_metadata(*ctx, held);
                return true;
            } catch (const Error &) {
                return false;
            }
        };
        d->client->publish(n, ctx->metadata(), deadline_after(timeout_ns), same_key);
        d->inbox.serve(n);  // the first name published through the handle is the one it serves
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_unpublish(sg_directory_t h, const char *name, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        d->client->unpublish(name_arg(name), deadline_after(timeout_ns));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_lookup(sg_directory_t h, const char *name, uint64_t timeout_ns, void *buf, size_t cap,
                                       size_t *len) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const std::string n = name_arg(name);
        auto blob = d->client->lookup(n, deadline_after(timeout_ns));
        if (!blob) fail(SG_ERR_NOT_FOUND, "no engine is published as \"" + n + "\"");
        *len = blob->size();
        if (query) return SG_OK;
        if (cap < blob->size()) fail(SG_ERR_BUFFER_TOO_SMALL, "the blob needs " + std::to_string(blob->size()) + " bytes");
        std::memcpy(buf, blob->data(), blob->size());
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_list(sg_directory_t h, const char *name_prefix, uint64_t timeout_ns, char *buf,
                                     size_t cap, size_t *len, size_t *count) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const auto names = d->client->list(name_prefix ? name_prefix : "", deadline_after(timeout_ns));
        std::string joined;
        for (const auto &n : names) joined.append(n).push_back('\0');
        *len = joined.size();
        if (count) *count = names.size();
        if (query) return SG_OK;
        if (cap < joined.size()) fail(SG_ERR_BUFFER_TOO_SMALL, "the names need " + std::to_string(joined.size()) + " bytes");
        std::memcpy(buf, joined.data(), joined.size());
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_wait(sg_directory_t h, const char *name, int present, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_directory_wait");
        auto d = lookup(directories(), raw(h), "directory");
        const std::string n = name_arg(name);
        if (!d->client->wait(n, present != 0, deadline_after(timeout_ns)))
            fail(SG_ERR_TIMEOUT, "\"" + n + "\" is still " + (present ? "absent" : "published"));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_connect(sg_directory_t h, const char *name, const sg_session_options_t *options,
                                        uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_directory_connect");
        auto d = lookup(directories(), raw(h), "directory");
        need(out, "out");
        const std::string n = name_arg(name);
        auto ctx = directory_context(*d);
        const uint64_t deadline = deadline_after(timeout_ns);
        auto blob = d->client->lookup(n, deadline);
        if (!blob) fail(SG_ERR_NOT_FOUND, "no engine is published as \"" + n + "\"");
        // The entry's signature first: a forged one gets nothing of ours, not even our blob.
        sg::wire::Hello peer = counting_auth_failures(*ctx, [&] { return core::parse_metadata(*ctx, *blob); });
        char from[32];
        std::snprintf(from, sizeof from, "ctx-%016llx", static_cast<unsigned long long>(ctx->id));
        d->client->request(n, from, ctx->metadata(), deadline);
        *out = add_session(*ctx, peer, options, false);
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_accept(sg_directory_t h, uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_directory_accept");
        auto d = lookup(directories(), raw(h), "directory");
        need(out, "out");
        if (!d->inbox.serving()) fail(SG_ERR_INVALID_STATE, "nothing is published through this directory handle");
        std::unique_lock lock(d->mu);
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(std::min<uint64_t>(timeout_ns, INT64_MAX / 2));
        if (!d->cv.wait_until(lock, until, [&] { return !d->accepted.empty() || d->stopping; }))
            fail(SG_ERR_TIMEOUT, "no session request arrived");
        if (d->accepted.empty()) fail(SG_ERR_INVALID_STATE, "the directory is being destroyed");
        *out = d->accepted.front();
        d->accepted.pop_front();
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_stats(sg_directory_t h, sg_directory_stats_t *stats) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(stats, "stats");
        if (stats->struct_size < sizeof(size_t))
            fail(SG_ERR_INVALID_ARGUMENT, "stats.struct_size is not set (call sg_directory_stats_init)");
        const sg::directory::Stats c = d->client->stats();
        sg_directory_stats_t s{};
        s.struct_size = sizeof s;
        s.requests = c.requests;
        s.failovers = c.failovers;
        s.keepalives = c.keepalives;
        s.leases_granted = c.leases_granted;
        s.sessions_accepted = d->sessions_accepted.load();
        s.requests_refused = d->requests_refused.load();
        s.names_taken_over = c.names_taken_over;
        s.names_restored = c.names_restored;
        const size_t keep = stats->struct_size;
        std::memcpy(stats, &s, std::min(keep, sizeof s));
        stats->struct_size = std::min(keep, sizeof s);
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_destroy(sg_directory_t h) {
    return guard(nullptr, [&] {
        not_in_callback("sg_directory_destroy");
        if (!h) return SG_OK;
        if (!directories().remove(raw(h))) fail(SG_ERR_INVALID_HANDLE, "directory handle is not live");
        return SG_OK;
    });
}
