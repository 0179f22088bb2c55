// Where the example programs and their tests find the checkpoints (examples/models/README.md):
// $SMARTGEN_MODEL for the one checkpoint a program takes, else $SMARTGEN_MODEL_DIR, else the build's
// SMARTGEN_DEFAULT_MODEL_DIR (the repository's examples/models). With SMARTGEN_REQUIRE_DATA=1
// (scripts/test.sh and CI set it) a missing file is a failure, never a skip: a suite that cannot find
// its data must not pass without testing quality.
#pragma once

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#ifndef SMARTGEN_DEFAULT_MODEL_DIR
#error "SMARTGEN_DEFAULT_MODEL_DIR must name the checkpoints' directory (examples/disagg/CMakeLists.txt sets it)"
#endif

namespace sg::disagg::model_files {

inline std::string dir() {
    const char* env = std::getenv("SMARTGEN_MODEL_DIR");
    return env && *env ? env : SMARTGEN_DEFAULT_MODEL_DIR;
}

inline std::string path(const char* name) { return (std::filesystem::path(dir()) / name).string(); }

// The story model, the default checkpoint of smartgen-disagg and smartgen-quality.
inline std::string stories() {
    if (const char* m = std::getenv("SMARTGEN_MODEL"); m && *m) return m;
    return path("stories260K.bin");
}

inline bool exists(const std::string& p) {
    std::error_code ec;
    return std::filesystem::is_regular_file(p, ec);
}

// True when a missing checkpoint or case file must fail the run (SMARTGEN_REQUIRE_DATA=1).
inline bool required() {
    const char* env = std::getenv("SMARTGEN_REQUIRE_DATA");
    return env && std::strcmp(env, "1") == 0;
}

// The exit status of a program whose data is missing: 77 (ctest's and automake's "skipped"), or 1
// when the data is required.
inline int missing_exit_status() { return required() ? 1 : 77; }

inline const char* how_to_point() {
    return "set SMARTGEN_MODEL_DIR to a directory holding stories260K.bin, retrieval2k.bin and "
           "retrieval2k-cases.json (the repository's examples/models has them)";
}

}  // namespace sg::disagg::model_files

// In a GoogleTest body: skips, or fails under SMARTGEN_REQUIRE_DATA=1, when the file at PATH is missing.
#define SG_NEED_DATA_FILE(path_expr)                                                                   \
    do {                                                                                               \
        const std::string sg_need_path_ = (path_expr);                                                 \
        if (!::sg::disagg::model_files::exists(sg_need_path_)) {                                       \
            if (::sg::disagg::model_files::required())                                                 \
                GTEST_FAIL() << sg_need_path_ << " not found, and SMARTGEN_REQUIRE_DATA=1 makes that a " \
                             << "failure (" << ::sg::disagg::model_files::how_to_point() << ")";        \
            GTEST_SKIP() << sg_need_path_ << " not found (" << ::sg::disagg::model_files::how_to_point() \
                         << ")";                                                                       \
        }                                                                                              \
    } while (0)
