// runtime/directory: reading etcd's gateway answers (through common/json_input.hpp, the runtime's
// one bounded JSON reader) and the encodings the directory writes (JSON string literals, base64 of
// keys and values). Internal to directory/ (its tests read it too).
#pragma once

#include "common/json_input.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace sg::directory::json {

using Value = nlohmann::ordered_json;

// A parsed answer; freed without allocating, even when memory has run out (json_input::Dom).
struct Document {
    json_input::Dom<Value> dom;
    const Value &root() const { return dom.value; }
};

// Parses a whole document; nullptr (with why) for anything malformed, a field given twice, nested
// deeper than 64, or longer than max_bytes. Never throws.
std::unique_ptr<Document> parse(std::string_view text, std::string *why = nullptr, size_t max_bytes = 64u << 20) noexcept;

const Value *get(const Value &v, std::string_view key);  // object member, else nullptr
std::optional<int64_t> as_int(const Value &v);          // an int64 number, or a string of its digits
const std::string *as_string(const Value &v);            // a string, else nullptr
bool is_true(const Value *v);                            // present and the literal true

// A JSON string literal, quotes included.
std::string quote(std::string_view s);

std::string base64_encode(std::string_view bytes);
// nullopt for anything but canonical padded base64 (etcd writes nothing else).
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace sg::directory::json
