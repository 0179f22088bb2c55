// The directory's reading of etcd's answers (over common/json_input.hpp's bounded reader) and the
// string encodings it writes itself.
#include "directory/json.hpp"

#include "common/common.hpp"

namespace sg::directory::json {

std::unique_ptr<Document> parse(std::string_view text, std::string *why, size_t max_bytes) noexcept {
    // Never throws: the watch stream parses inside libcurl's callback, where nothing may escape.
    try {
        if (text.size() > max_bytes) {
            if (why) *why = "longer than " + std::to_string(max_bytes) + " bytes";
            return nullptr;
        }
        // Answers nest 5 levels deep (result.events[].kv) and hold at most 8 fields an object.
        json_input::check<Value>(text, json_input::Limits{64, 64, SG_ERR_PROTOCOL, "etcd's answer"});
        auto doc = std::make_unique<Document>();
        json_input::parse_into(text, doc->dom);
        return doc;
    } catch (const Error &e) {
        if (why) *why = e.message();
    } catch (const std::exception &e) {
        if (why) *why = e.what();
    } catch (...) {
        if (why) *why = "unknown error";
    }
    return nullptr;
}

const Value *get(const Value &v, std::string_view key) {
    if (!v.is_object()) return nullptr;
    auto it = v.find(key);
    return it == v.end() ? nullptr : &*it;
}

std::optional<int64_t> as_int(const Value &v) {
    if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
    if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        return u <= uint64_t(INT64_MAX) ? std::optional<int64_t>(int64_t(u)) : std::nullopt;
    }
    if (!v.is_string()) return std::nullopt;
    const std::string &t = v.get_ref<const std::string &>();
    if (t.empty() || t.size() > 20) return std::nullopt;
    size_t i = t[0] == '-' ? 1 : 0;
    if (i == t.size()) return std::nullopt;
    uint64_t n = 0;
    for (; i < t.size(); ++i) {
        if (t[i] < '0' || t[i] > '9') return std::nullopt;
        const uint64_t d = uint64_t(t[i] - '0');
        if (n > (uint64_t(INT64_MAX) - d) / 10) return std::nullopt;
        n = n * 10 + d;
    }
    return t[0] == '-' ? -int64_t(n) : int64_t(n);
}

const std::string *as_string(const Value &v) { return v.is_string() ? &v.get_ref<const std::string &>() : nullptr; }

bool is_true(const Value *v) { return v && v->is_boolean() && v->get<bool>(); }

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}  // namespace

std::string quote(std::string_view s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (uint8_t(c) < 0x20) {
            static const char digits[] = "0123456789abcdef";
            out += "\\u00";
            out += digits[uint8_t(c) >> 4];
            out += digits[uint8_t(c) & 15];
        } else {
            out += c;
        }
    }
    return out + "\"";
}

std::string base64_encode(std::string_view bytes) {
    std::string out;
    out.reserve((bytes.size() + 2) / 3 * 4);
    size_t i = 0;
    for (; i + 3 <= bytes.size(); i += 3) {
        const uint32_t v = uint32_t(uint8_t(bytes[i])) << 16 | uint32_t(uint8_t(bytes[i + 1])) << 8 | uint8_t(bytes[i + 2]);
        for (int k = 18; k >= 0; k -= 6) out += kAlphabet[(v >> k) & 63];
    }
    if (const size_t rest = bytes.size() - i) {
        uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
        if (rest == 2) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
        out += kAlphabet[(v >> 18) & 63];
        out += kAlphabet[(v >> 12) & 63];
        out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
        out += '=';
    }
    return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
    if (text.size() % 4) return std::nullopt;
    auto digit = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+') return 62;
        if (c == '/') return 63;
        return -1;
    };
    std::string out;
    out.reserve(text.size() / 4 * 3);
    for (size_t i = 0; i < text.size(); i += 4) {
        const bool last = i + 4 == text.size();
        const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=') : 0;
        if (pad == 1 && text[i + 2] == '=') return std::nullopt;
        uint32_t v = 0;
        for (int k = 0; k < 4; ++k) {
            const int d = k >= 4 - pad ? 0 : digit(text[i + k]);
            if (d < 0) return std::nullopt;
            v = v << 6 | uint32_t(d);
        }
        // Canonical: the bits the padding drops are zero.
        if ((pad == 1 && (v & 0xff)) || (pad == 2 && (v & 0xffff))) return std::nullopt;
        out += char(v >> 16);
        if (pad < 2) out += char((v >> 8) & 0xff);
        if (pad < 1) out += char(v & 0xff);
    }
    return out;
}

}  // namespace sg::directory::json
