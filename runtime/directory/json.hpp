// runtime/directory: the JSON that etcd's gateway speaks, and base64 (its keys and values) — only as
// much as the directory needs. Internal to directory/ (its tests read it too).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sg::directory::json {

// A parsed value. Numbers keep their text: etcd writes int64 fields as strings or numbers, and
// as_int reads either.
struct Value {
    enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
    bool b = false;
    std::string text;  // number or string
    std::vector<Value> items;
    std::map<std::string, Value> members;

    const Value *get(std::string_view key) const;  // object member or null
    std::optional<int64_t> as_int() const;           // number, or a string of digits
    const std::string *as_string() const;
};

// Parses a whole document; nullopt (with why) for anything malformed, nested deeper than 64, or
// longer than max_bytes.
std::optional<Value> parse(std::string_view text, std::string *why = nullptr, size_t max_bytes = 64u << 20);

// A JSON string literal, quotes included.
std::string quote(std::string_view s);

std::string base64_encode(std::string_view bytes);
// nullopt for anything but canonical padded base64 (etcd writes nothing else).
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace sg::directory::json
