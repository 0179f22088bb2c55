// An environment variable set for the life of a scope and put back afterwards: for settings the
// library reads when a context is created (SG_TRANSFER_VERIFY, SG_STAGING_THRESHOLD, ...).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace sgtest {

class ScopedEnv {
  public:
    ScopedEnv(const char *name, const char *value) : name_(name) {
        if (const char *old = std::getenv(name)) old_ = old;
        ::setenv(name, value, 1);
    }
    ~ScopedEnv() {
        if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
        else ::unsetenv(name_.c_str());
    }
    ScopedEnv(const ScopedEnv &) = delete;
    ScopedEnv &operator=(const ScopedEnv &) = delete;

  private:
    std::string name_;
    std::optional<std::string> old_;
};

}  // namespace sgtest
