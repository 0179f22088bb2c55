// The integration tests' context: the test key, no log, the given provider (and peer timeout: 0
// is the library's default).
#pragma once

#include <gtest/gtest.h>
#include <smartgen/smartgen.h>

#include "../test_key.h"

inline sg_context_t make_test_context(const char *provider = "tcp", uint32_t peer_timeout_ms = 0) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider;
    o.log_level = SG_LOG_OFF;
    o.peer_timeout_ms = peer_timeout_ms;
    SG_TEST_USE_KEY(o);
    sg_context_t c = nullptr;
    EXPECT_EQ(sg_context_create(&o, &c, nullptr), SG_OK) << sg_last_error_message();
    return c;
}
