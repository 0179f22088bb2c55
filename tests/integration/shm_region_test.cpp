// shm endpoints' regions in /dev/shm: a killed process leaves its region behind, and a later
// process must neither trip over it nor let such leftovers pile up. A fresh-clone CI run failed with
// "fi_enable: Device or resource busy" when a soak process got the pid of one killed earlier, whose
// region under the provider's default name "<pid>:<uid>:<index>" was still there.
#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

sg_context_t make_shm_context() {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "shm";
    o.log_level = SG_LOG_OFF;
    SG_TEST_USE_KEY(o);
    sg_context_t c = nullptr;
    EXPECT_EQ(sg_context_create(&o, &c, nullptr), SG_OK) << sg_last_error_message();
    return c;
}

bool shm_exists(const std::string &name) {
    struct stat st {};
    return ::stat(("/dev/shm/" + name).c_str(), &st) == 0;
}

// Creates a region file as a dead or live owner would have left it, aged by `age_seconds`.
int make_region(const std::string &name, time_t age_seconds) {
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << name << ": " << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, 4096), 0);
    const timespec when[2] = {{std::time(nullptr) - age_seconds, 0}, {std::time(nullptr) - age_seconds, 0}};
    EXPECT_EQ(futimens(fd, when), 0);
    return fd;
}

std::vector<std::string> regions_of_this_process() {
    const std::string prefix = "smartgen-" + std::to_string(getpid()) + "-";
    std::vector<std::string> out;
    if (DIR *dir = opendir("/dev/shm")) {
        while (dirent *e = readdir(dir))
            if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
        closedir(dir);
    }
    return out;
}

TEST(ShmRegions, LeftoversOfAnEarlierProcessWithThisPidDoNotBlockAContext) {
    // The provider's default names for this pid's first endpoints, as a killed process would leave them.
    std::vector<std::string> stale;
    for (int index = 0; index < 8; ++index) {
        stale.push_back(std::to_string(getpid()) + ":" + std::to_string(getuid()) + ":" + std::to_string(index));
        shm_unlink(stale.back().c_str());
        ::close(make_region(stale.back(), 3600));
    }
    sg_context_t a = make_shm_context();
    sg_context_t b = make_shm_context();
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    sg_context_destroy(b);
    sg_context_destroy(a);
    for (const auto &name : stale) shm_unlink(name.c_str());
}

TEST(ShmRegions, EachContextHoldsOneRegionThatGoesWithIt) {
    ASSERT_TRUE(regions_of_this_process().empty());
    sg_context_t a = make_shm_context();
    sg_context_t b = make_shm_context();
    EXPECT_EQ(regions_of_this_process().size(), 2u);
    sg_context_destroy(a);
    EXPECT_EQ(regions_of_this_process().size(), 1u);
    sg_context_destroy(b);
    EXPECT_TRUE(regions_of_this_process().empty());
}

TEST(ShmRegions, AnOrphanedRegionIsRemovedWhileLiveAndNewbornOnesStay) {
    // pids beyond pid_max's 2^22 ceiling, so no live process is ever confused with these.
    const std::string orphan = "smartgen-99999991-00000000000000a1";
    const std::string live = "smartgen-99999992-00000000000000b2";
    const std::string newborn = "smartgen-99999993-00000000000000c3";
    const std::string unrelated = "smartgen-99999994-00000000000000d4_7";  // a provider's per-message file
    for (const auto *n : {&orphan, &live, &newborn, &unrelated}) shm_unlink(n->c_str());
    ::close(make_region(orphan, 120));
    const int live_fd = make_region(live, 120);
    ASSERT_EQ(flock(live_fd, LOCK_SH), 0);  // what a living endpoint holds
    ::close(make_region(newborn, 0));
    ::close(make_region(unrelated, 120));

    sg_context_t c = make_shm_context();
    ASSERT_NE(c, nullptr);
    EXPECT_FALSE(shm_exists(orphan)) << "an unlocked region two minutes old has no owner and is removed";
    EXPECT_TRUE(shm_exists(live)) << "a region whose owner holds its lock is in use";
    EXPECT_TRUE(shm_exists(newborn)) << "a region younger than a minute may not be locked yet";
    EXPECT_TRUE(shm_exists(unrelated)) << "only region names SmartGen makes are judged";
    sg_context_destroy(c);

    ::close(live_fd);
    for (const auto *n : {&orphan, &live, &newborn, &unrelated}) shm_unlink(n->c_str());
}

}  // namespace
