/* The pre-shared key the tests' contexts authenticate with (C and C++). A real deployment reads its
 * key from a secret store or SG_AUTH_KEY_FILE; tests that check refusals use other keys. */
#ifndef SMARTGEN_TEST_KEY_H
#define SMARTGEN_TEST_KEY_H

static const char sg_test_auth_key[] = "smartgen-test-key-not-a-secret-0123456789";

#define SG_TEST_USE_KEY(options)                                   \
    do {                                                           \
        (options).auth_key = sg_test_auth_key;                     \
        (options).auth_key_len = sizeof sg_test_auth_key - 1;      \
    } while (0)

#endif
