// runtime/common: the one bounded JSON reader of the runtime (nlohmann underneath), for the text
// that comes from outside: selection profiles (select/) and etcd's answers (directory/).
// Header-only; each caller gives its Limits.
//
// nlohmann's DOM costs more than the text in three ways, each refused here in one linear pass that
// names the JSON path it stopped at, before any DOM is built:
//   - an ordered_json object inserts each field in linear time, so an object with n fields costs
//     n^2: an object may hold at most max_fields fields, each once (a repeated field would otherwise
//     win silently);
//   - a value nested n deep costs n stack frames when it is printed in an error message: at most
//     max_depth levels;
//   - a number beyond a double is an out_of_range exception, not a parse error: it becomes the
//     caller's status naming the field.
// Byte bounds come before this pass (each caller's). Below: building and freeing the DOM so that
// running out of memory is an exception the ABI reports, never std::terminate.
#pragma once

#include "common/common.hpp"

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace sg::json_input {

// What a caller reads under, and how it names a refusal: fail(status, what + ": " + path + ...).
struct Limits {
    size_t max_depth;
    size_t max_fields;  // per object
    sg_status_t status;
    const char *what;   // "profile", "etcd's answer"
};

template <class Json>
class Guard : public nlohmann::json_sax<Json> {
  public:
    explicit Guard(const Limits &limits) : limits_(limits) {}

    using number_integer_t = typename Json::number_integer_t;
    using number_unsigned_t = typename Json::number_unsigned_t;
    using number_float_t = typename Json::number_float_t;
    using string_t = typename Json::string_t;
    using binary_t = typename Json::binary_t;

    bool null() override { return value(); }
    bool boolean(bool) override { return value(); }
    bool number_integer(number_integer_t) override { return value(); }
    bool number_unsigned(number_unsigned_t) override { return value(); }
    bool number_float(number_float_t, const string_t &) override { return value(); }
    bool string(string_t &) override { return value(); }
    bool binary(binary_t &) override { return value(); }

    bool start_object(std::size_t) override { return open(false); }
    bool start_array(std::size_t) override { return open(true); }
    bool end_object() override { return close(); }
    bool end_array() override { return close(); }

    bool key(string_t &k) override {
        Frame &f = frames_.back();
        f.key = k;
        for (const std::string &seen : f.keys)
            if (seen == k) bad(path(), "given twice");
        if (f.keys.size() == limits_.max_fields)
            bad(path(), "an object may have at most " + std::to_string(limits_.max_fields) + " fields");
        f.keys.push_back(k);
        return true;
    }

    bool parse_error(std::size_t position, const std::string &token, const nlohmann::detail::exception &ex) override {
        // 406 is nlohmann's out_of_range "number overflow": a well-formed number no double holds.
        if (ex.id == 406)
            bad(path(), "number out of range: " + token.substr(0, 64));
        const std::string where = frames_.empty() ? "" : " (in " + (path().empty() ? "the top level" : path()) + ")";
        fail(limits_.status, std::string(limits_.what) + ": not valid JSON at byte " + std::to_string(position) + where +
                                 ": " + ex.what());
    }

  private:
    struct Frame {
        bool array;
        size_t next = 0;                // arrays: index of the next element
        std::string key;                // objects: the field being read
        std::vector<std::string> keys;  // objects: fields seen (at most kMaxFields)
    };

    [[noreturn]] void bad(const std::string &where, const std::string &why) const {
        fail(limits_.status, std::string(limits_.what) + ": " + (where.empty() ? std::string("(top level)") : where) + ": " +
                                 why);
    }

    // The path of the value being read now (before value() or open() counts it).
    std::string path() const {
        std::string p;
        for (const Frame &f : frames_) {
            if (f.array) {
                p.append("[").append(std::to_string(f.next)).append("]");
            } else {
                if (!p.empty()) p.append(".");
                p.append(f.key);
            }
        }
        return p;
    }

    bool value() {
        if (!frames_.empty() && frames_.back().array) frames_.back().next++;
        return true;
    }
    bool open(bool array) {
        if (frames_.size() == limits_.max_depth)
            bad(path(), "nested deeper than " + std::to_string(limits_.max_depth) + " levels");
        frames_.push_back(Frame{array});
        return true;
    }
    bool close() {
        frames_.pop_back();
        return value();  // the object or array just closed is one element of its parent
    }

    const Limits limits_;
    std::vector<Frame> frames_;
};

// Checks `text` under `limits`; throws Error(limits.status) naming the path.
template <class Json>
void check(std::string_view text, const Limits &limits) {
    Guard<Json> guard(limits);
    Json::sax_parse(text.begin(), text.end(), &guard);
}

// ---- a DOM that can be freed when memory has run out ----
// nlohmann's destructor moves a container's children onto a heap-allocated stack before freeing
// them. When an allocation has just failed, that stack's allocation fails too, inside a destructor
// (during the unwinding of the bad_alloc): std::terminate, where the host must get SG_ERR_NO_MEMORY.
// dismantle() frees a DOM leaf first, the last entry of the deepest container at a time, so that
// only scalars and empty containers are ever destroyed, which need no stack. O(values x depth).

template <class Json>
Json *last_child(Json &j) noexcept {
    if (auto *a = j.template get_ptr<typename Json::array_t *>()) return a->empty() ? nullptr : &a->back();
    if (auto *o = j.template get_ptr<typename Json::object_t *>()) return o->empty() ? nullptr : &o->back().second;
    return nullptr;
}

template <class Json>
void dismantle(Json &root) noexcept {
    for (;;) {
        Json *parent = &root;
        Json *last = last_child(root);
        if (!last) return;
        while (Json *deeper = last_child(*last)) {
            parent = last;
            last = deeper;
        }
        // `last` is a scalar or an empty container: removing it allocates nothing.
        if (auto *a = parent->template get_ptr<typename Json::array_t *>())
            a->pop_back();
        else
            parent->template get_ptr<typename Json::object_t *>()->pop_back();
    }
}

// The DOM of a checked text, dismantled (not destroyed) when it goes out of scope.
template <class Json>
struct Dom {
    Json value;
    Dom() = default;
    Dom(const Dom &) = delete;
    Dom &operator=(const Dom &) = delete;
    ~Dom() { dismantle(value); }
};

// Parses `text` (already checked) into dom.value. A failure part way leaves a partial DOM there,
// which the Dom still frees safely; nlohmann's own parse() would destroy it while unwinding.
template <class Json>
void parse_into(std::string_view text, Dom<Json> &dom) {
    nlohmann::detail::json_sax_dom_parser<Json> builder(dom.value);
    Json::sax_parse(text.begin(), text.end(), &builder);
}

}  // namespace sg::json_input
