// Fuzzer: what the directory reads from an etcd member (runtime/directory/json.hpp over the bounded
// reader of common/json_input.hpp): answers
// parsed as JSON, and keys and values decoded from base64. A member is infrastructure, but one
// that is compromised or confused must cost a refusal, never a crash or an unbounded walk.
//
// The input is the answer's text. A document that parses is walked as the client walks an answer
// (header.revision, kvs[].key/value, result.events[].type); every string found is base64-decoded,
// and what decodes must encode back to the same text (etcd writes canonical base64 only, and the
// decoder refuses anything else). Any input's bytes must survive encode then decode unchanged.
#include "directory/json.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

using namespace sg::directory;

namespace {

void check_base64(const std::string &text) {
    const auto bytes = json::base64_decode(text);
    if (bytes && json::base64_encode(*bytes) != text) {
        std::fprintf(stderr, "base64 %s decodes, but not back to itself\n", text.c_str());
        std::abort();
    }
}

void walk(const json::Value &v, int depth) {
    if (const std::string *s = json::as_string(v)) check_base64(*s);
    (void)json::as_int(v);
    if (v.is_array() || v.is_object())
        for (const json::Value &item : v) walk(item, depth + 1);
    if (const json::Value *h = json::get(v, "header"))
        if (const json::Value *r = json::get(*h, "revision")) (void)json::as_int(*r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string_view text(reinterpret_cast<const char *>(data), size);
    std::string why;
    if (auto doc = json::parse(text, &why, 1u << 20)) walk(doc->root(), 0);
    const std::string raw(text);
    const auto back = json::base64_decode(json::base64_encode(raw));
    if (!back || *back != raw) {
        std::fprintf(stderr, "%zu bytes do not survive base64\n", size);
        std::abort();
    }
    return 0;
}
