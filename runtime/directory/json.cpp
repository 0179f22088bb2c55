#include "directory/json.hpp"

#include <cstring>

namespace sg::directory::json {

const Value *Value::get(std::string_view key) const {
    if (kind != Kind::object) return nullptr;
    auto it = members.find(std::string(key));
    return it == members.end() ? nullptr : &it->second;
}

std::optional<int64_t> Value::as_int() const {
    if (kind != Kind::number && kind != Kind::string) return std::nullopt;
    const std::string &t = text;
    if (t.empty() || t.size() > 20) return std::nullopt;
    size_t i = t[0] == '-' ? 1 : 0;
    if (i == t.size()) return std::nullopt;
    uint64_t v = 0;
    for (; i < t.size(); ++i) {
        if (t[i] < '0' || t[i] > '9') return std::nullopt;
        const uint64_t d = uint64_t(t[i] - '0');
        if (v > (uint64_t(INT64_MAX) - d) / 10) return std::nullopt;
        v = v * 10 + d;
    }
    return t[0] == '-' ? -int64_t(v) : int64_t(v);
}

const std::string *Value::as_string() const { return kind == Kind::string ? &text : nullptr; }

namespace {

constexpr int kMaxDepth = 64;

struct Parser {
    std::string_view s;
    size_t at = 0;
    std::string why;

    bool fail(const char *what) {
        if (why.empty()) why = std::string(what) + " at byte " + std::to_string(at);
        return false;
    }
    void skip_space() {
        while (at < s.size() && (s[at] == ' ' || s[at] == '\t' || s[at] == '\n' || s[at] == '\r')) ++at;
    }
    bool literal(const char *word) {
        const size_t n = std::strlen(word);
        if (s.substr(at, n) != word) return fail("unknown literal");
        at += n;
        return true;
    }
    static int hex(char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    }
    bool hex4(uint32_t &cp) {
        if (at + 4 > s.size()) return fail("short \\u escape");
        cp = 0;
        for (int i = 0; i < 4; ++i) {
            const int h = hex(s[at++]);
            if (h < 0) return fail("bad \\u escape");
            cp = cp * 16 + uint32_t(h);
        }
        return true;
    }
    static void utf8(std::string &out, uint32_t cp) {
        if (cp < 0x80) {
            out += char(cp);
        } else if (cp < 0x800) {
            out += char(0xc0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            out += char(0xe0 | (cp >> 12));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        } else {
            out += char(0xf0 | (cp >> 18));
            out += char(0x80 | ((cp >> 12) & 0x3f));
            out += char(0x80 | ((cp >> 6) & 0x3f));
            out += char(0x80 | (cp & 0x3f));
        }
    }
    bool string(std::string &out) {
        ++at;  // the opening quote
        while (at < s.size()) {
            const char c = s[at++];
            if (c == '"') return true;
            if (uint8_t(c) < 0x20) return fail("control character in a string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (at >= s.size()) break;
            const char e = s[at++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t cp = 0;
                    if (!hex4(cp)) return false;
                    if (cp >= 0xd800 && cp < 0xdc00) {
                        uint32_t lo = 0;
                        if (s.substr(at, 2) != "\\u") return fail("lone surrogate");
                        at += 2;
                        if (!hex4(lo) || lo < 0xdc00 || lo >= 0xe000) return fail("bad surrogate pair");
                        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    } else if (cp >= 0xdc00 && cp < 0xe000) {
                        return fail("lone surrogate");
                    }
                    utf8(out, cp);
                    break;
                }
                default: return fail("bad escape");
            }
        }
        return fail("unterminated string");
    }
    bool number(std::string &out) {
        const size_t start = at;
        if (at < s.size() && s[at] == '-') ++at;
        size_t digits = 0;
        while (at < s.size() && ((s[at] >= '0' && s[at] <= '9') || s[at] == '.' || s[at] == 'e' || s[at] == 'E' ||
                                 s[at] == '+' || s[at] == '-')) {
            ++at;
            ++digits;
        }
        if (!digits) return fail("bad number");
        out.assign(s.substr(start, at - start));
        return true;
    }
    bool value(Value &v, int depth) {
        if (depth > kMaxDepth) return fail("nested too deep");
        skip_space();
        if (at >= s.size()) return fail("unexpected end");
        const char c = s[at];
        if (c == '{') {
            v.kind = Value::Kind::object;
            ++at;
            skip_space();
            if (at < s.size() && s[at] == '}') {
                ++at;
                return true;
            }
            for (;;) {
                skip_space();
                if (at >= s.size() || s[at] != '"') return fail("expected a member name");
                std::string key;
                if (!string(key)) return false;
                skip_space();
                if (at >= s.size() || s[at] != ':') return fail("expected ':'");
                ++at;
                Value member;
                if (!value(member, depth + 1)) return false;
                v.members[key] = std::move(member);
                skip_space();
                if (at < s.size() && s[at] == ',') {
                    ++at;
                    continue;
                }
                if (at < s.size() && s[at] == '}') {
                    ++at;
                    return true;
                }
                return fail("expected ',' or '}'");
            }
        }
        if (c == '[') {
            v.kind = Value::Kind::array;
            ++at;
            skip_space();
            if (at < s.size() && s[at] == ']') {
                ++at;
                return true;
            }
            for (;;) {
                Value item;
                if (!value(item, depth + 1)) return false;
                v.items.push_back(std::move(item));
                skip_space();
                if (at < s.size() && s[at] == ',') {
                    ++at;
                    continue;
                }
                if (at < s.size() && s[at] == ']') {
                    ++at;
                    return true;
                }
                return fail("expected ',' or ']'");
            }
        }
        if (c == '"') {
            v.kind = Value::Kind::string;
            return string(v.text);
        }
        if (c == 't' || c == 'f') {
            v.kind = Value::Kind::boolean;
            v.b = c == 't';
            return literal(v.b ? "true" : "false");
        }
        if (c == 'n') return literal("null");
        v.kind = Value::Kind::number;
        return number(v.text);
    }
};

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

}  // namespace

std::optional<Value> parse(std::string_view text, std::string *why, size_t max_bytes) {
    if (text.size() > max_bytes) {
        if (why) *why = "longer than " + std::to_string(max_bytes) + " bytes";
        return std::nullopt;
    }
    Parser p{text};
    Value v;
    if (p.value(v, 0)) {
        p.skip_space();
        if (p.at == text.size()) return v;
        p.fail("trailing bytes");
    }
    if (why) *why = p.why;
    return std::nullopt;
}

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
