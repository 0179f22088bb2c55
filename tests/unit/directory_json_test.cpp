// The directory's JSON and base64 (runtime/directory/json.hpp over common/json_input.hpp): what
// etcd's gateway writes parses, escapes and surrogate pairs decode to UTF-8, int64 fields read from
// strings or numbers, and malformed or hostile text (a field given twice included) is refused with a
// reason instead of read past its end or recursed into without bound.
#include "directory/directory.hpp"
#include "directory/json.hpp"

#include <gtest/gtest.h>

#include <string>

namespace json = sg::directory::json;

TEST(DirectoryJson, AnEtcdRangeAnswerParses) {
    const std::string text =
        R"({"header":{"cluster_id":"3249","revision":"17","raft_term":"2"},)"
        R"("kvs":[{"key":"Zm9v","create_revision":"2","value":"YmFy","lease":"7587"}],"count":"1"})";
    auto doc = json::parse(text);
    ASSERT_TRUE(doc);
    const json::Value &v = doc->root();
    EXPECT_EQ(json::as_int(*json::get(*json::get(v, "header"), "revision")), 17);
    const json::Value &kv = json::get(v, "kvs")->at(0);
    EXPECT_EQ(json::base64_decode(*json::as_string(*json::get(kv, "key"))), "foo");
    EXPECT_EQ(json::base64_decode(*json::as_string(*json::get(kv, "value"))), "bar");
    EXPECT_EQ(json::get(v, "missing"), nullptr);
    EXPECT_EQ(json::get(kv.at("key"), "x"), nullptr) << "a string has no members";
}

TEST(DirectoryJson, StringsNumbersAndLiterals) {
    auto doc = json::parse(R"( ["a\"b\\c\/\n\t", "\u00e9\ud83d\ude00", -12, 9223372036854775807, "x1", 1.5, true, false, null, {}, 9223372036854775808, "-42"] )");
    ASSERT_TRUE(doc);
    const json::Value &v = doc->root();
    EXPECT_EQ(*json::as_string(v[0]), "a\"b\\c/\n\t");
    EXPECT_EQ(*json::as_string(v[1]), "\xc3\xa9\xf0\x9f\x98\x80");
    EXPECT_EQ(json::as_int(v[2]), -12);
    EXPECT_EQ(json::as_int(v[3]), INT64_MAX);
    EXPECT_FALSE(json::as_int(v[4]));
    EXPECT_FALSE(json::as_int(v[5])) << "not an integer";
    EXPECT_TRUE(json::is_true(&v[6]));
    EXPECT_FALSE(json::is_true(&v[7]));
    EXPECT_TRUE(v[8].is_null());
    EXPECT_FALSE(json::as_int(v[10])) << "a number beyond int64";
    EXPECT_EQ(json::as_int(v[11]), -42);
    EXPECT_FALSE(json::as_int(json::parse(R"("9223372036854775808")")->root())) << "beyond int64";
}

TEST(DirectoryJson, MalformedAndHostileTextIsRefusedWithAReason) {
    for (const char *bad : {"", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,}", "\"abc", "\"\\x\"", "\"\\ud800\"",
                            "\"\\udc00\"", "\"\\u12\"", "tru", "[1] 2", "\"a\nb\"", "-", "{1:2}", "01", "NaN", "'a'",
                            "{\"a\":1,\"a\":2}"}) {
        std::string why;
        EXPECT_FALSE(json::parse(bad, &why)) << bad;
        EXPECT_FALSE(why.empty()) << bad;
    }
    std::string deep(100000, '[');
    std::string why;
    EXPECT_FALSE(json::parse(deep, &why));
    EXPECT_NE(why.find("deep"), std::string::npos) << why;
    EXPECT_FALSE(json::parse(R"({"kvs":[{"key":"a","key":"b"}]})", &why));
    EXPECT_NE(why.find("kvs[0].key: given twice"), std::string::npos) << why;
    EXPECT_TRUE(json::parse(std::string(60, '[') + std::string(60, ']')));
    EXPECT_FALSE(json::parse(std::string(100, ' ') + "1", &why, 50)) << "longer than the bound";
}

TEST(DirectoryJson, Base64IsCanonicalBothWays) {
    for (const std::string &s : std::vector<std::string>{"", "f", "fo", "foo", "foob", "fooba", "foobar", std::string("\0\xff\x10", 3)})
        EXPECT_EQ(json::base64_decode(json::base64_encode(s)), s);
    EXPECT_EQ(json::base64_encode("foobar"), "Zm9vYmFy");
    EXPECT_EQ(json::base64_encode("fo"), "Zm8=");
    for (const char *bad : {"Zm9", "Zm9v!", "Zg", "Zh==", "Zm8A=", "=Zm8", "Zm=8", "Z===", "===="})
        EXPECT_FALSE(json::base64_decode(bad)) << bad;
}

TEST(DirectoryJson, QuoteEscapesWhatJsonNeeds) {
    EXPECT_EQ(json::quote("a\"b\\c\x01"), "\"a\\\"b\\\\c\\u0001\"");
    auto doc = json::parse(json::quote(std::string("x\0y\n\"", 5)));
    ASSERT_TRUE(doc);
    EXPECT_EQ(*json::as_string(doc->root()), std::string("x\0y\n\"", 5));
}

TEST(DirectoryNames, AndEndpointsAreChecked) {
    EXPECT_NO_THROW(sg::directory::check_name("prefill/node-3/gpu_0.v2"));
    for (const std::string &bad : std::vector<std::string>{"", "/a", "a/", "a//b", "a b", "a:b", std::string(201, 'x')})
        EXPECT_THROW(sg::directory::check_name(bad), sg::Error) << bad;
    EXPECT_EQ(sg::directory::parse_endpoints(" 10.0.0.1:2379 , http://h:1/"),
              (std::vector<std::string>{"http://10.0.0.1:2379", "http://h:1"}));
    for (const char *bad : {"", ",", "a:1,,b:2", "ftp://a:1", "http://", "http://a b:1", "http://a:1/v3"})
        EXPECT_THROW(sg::directory::parse_endpoints(bad), sg::Error) << bad;
}
