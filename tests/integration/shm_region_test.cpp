// shm endpoints' regions in /dev/shm: a killed process leaves its region behind, and a later
// process must neither trip over it nor let such leftovers pile up. A fresh-clone CI run failed with
// "fi_enable: Device or resource busy" when a soak process got the pid of one killed earlier, whose
// region under the provider's default name "<pid>:<uid>:<index>" was still there.
#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

namespace {

sg_context_t make_shm_context(uint32_t peer_timeout_ms = 0) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = "shm";
    o.log_level = SG_LOG_OFF;
    if (peer_timeout_ms) o.peer_timeout_ms = peer_timeout_ms;
    SG_TEST_USE_KEY(o);
    sg_context_t c = nullptr;
    EXPECT_EQ(sg_context_create(&o, &c, nullptr), SG_OK) << sg_last_error_message();
    return c;
}

// A shm context's endpoint (and so its region) opens at creation (libfabric.cpp says why a tcp one
// waits for its first use); asking for the metadata, which names it, must not open another.
void open_endpoint(sg_context_t c) {
    std::vector<uint8_t> blob(4096);
    size_t len = 0;
    EXPECT_EQ(sg_context_get_metadata(c, blob.data(), blob.size(), &len), SG_OK) << sg_last_error_message();
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

// Waits up to `seconds` for a message from the peer across the fabric.
sg_status_t wait_for_word(sg_session_t s, int seconds) {
    char word[16];
    size_t len = 0;
    sg_status_t heard = SG_ERR_AGAIN;
    for (int i = 0; i < seconds * 100 && heard == SG_ERR_AGAIN; ++i) {
        heard = sg_session_next_notification(s, word, sizeof word, &len);
        if (heard == SG_ERR_AGAIN) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return heard;
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
    open_endpoint(a);
    open_endpoint(b);
    sg_context_destroy(b);
    sg_context_destroy(a);
    for (const auto &name : stale) shm_unlink(name.c_str());
}

TEST(ShmRegions, EachContextHoldsOneRegionThatGoesWithIt) {
    ASSERT_TRUE(regions_of_this_process().empty());
    sg_context_t a = make_shm_context();
    sg_context_t b = make_shm_context();
    EXPECT_EQ(regions_of_this_process().size(), 2u) << "a shm context opens its endpoint at creation";
    open_endpoint(a);  // and never a second one
    open_endpoint(b);
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
    open_endpoint(c);  // the context reaped the orphans before it made its own region
    EXPECT_FALSE(shm_exists(orphan)) << "an unlocked region two minutes old has no owner and is removed";
    EXPECT_TRUE(shm_exists(live)) << "a region whose owner holds its lock is in use";
    EXPECT_TRUE(shm_exists(newborn)) << "a region younger than a minute may not be locked yet";
    EXPECT_TRUE(shm_exists(unrelated)) << "only region names SmartGen makes are judged";
    sg_context_destroy(c);

    ::close(live_fd);
    for (const auto *n : {&orphan, &live, &newborn, &unrelated}) shm_unlink(n->c_str());
}

// libfabric 1.17's shm provider queues a message under a spin lock inside the target's region; a
// target killed while holding it left the next post to it spinning forever, and the soak saw a
// decode context wedged that way (its progress thread stuck behind the poster). A post to a SmartGen
// shm peer whose process is gone now fails at once as a lost peer, without entering the provider:
// here the loss is reported long before the peer timeout, which is the only other way to learn it.
TEST(ShmRegions, APostToAPeerWhoseProcessIsGoneFailsAtOnceAsALostPeer) {
    int port_pipe[2];
    ASSERT_EQ(pipe(port_pipe), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // the peer: accepts one session, then waits to be killed
        // Never outlive the test, whichever way it ends (a leftover would hold ctest's output pipe).
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(60);
        ::close(port_pipe[0]);
        sg_context_t c = make_shm_context(60000);
        sg_listener_t l = nullptr;
        uint16_t port = 0;
        if (!c || sg_listener_create(c, "127.0.0.1", 0, &l, nullptr) != SG_OK || sg_listener_port(l, &port) != SG_OK)
            _exit(3);
        if (write(port_pipe[1], &port, sizeof port) != ssize_t(sizeof port)) _exit(4);
        sg_session_options_t so;
        sg_session_options_init(&so);
        sg_session_t s = nullptr;
        if (sg_session_accept(l, &so, 20ull * 1000000000ull, &s, nullptr) != SG_OK) _exit(5);
        // A message across the fabric, so that both sides' connections exist and either may send.
        if (sg_session_notify(s, "ready", 5) != SG_OK) _exit(6);
        for (;;) pause();
    }
    struct KillOnExit {
        pid_t pid;
        ~KillOnExit() {
            if (pid > 0 && kill(pid, SIGKILL) == 0) waitpid(pid, nullptr, 0);
        }
    } reaper{child};
    ::close(port_pipe[1]);
    uint16_t port = 0;
    ASSERT_EQ(read(port_pipe[0], &port, sizeof port), ssize_t(sizeof port));
    ::close(port_pipe[0]);

    sg_context_t c = make_shm_context(60000);  // a minute: only the post can report this loss in time
    ASSERT_NE(c, nullptr);
    sg_session_options_t so;
    sg_session_options_init(&so);
    sg_session_t s = nullptr;
    ASSERT_EQ(sg_session_connect(c, "127.0.0.1", port, &so, 20ull * 1000000000ull, &s, nullptr), SG_OK)
        << sg_last_error_message();
    // Only the side with the lower context id speaks first; each waits for a word from the other.
    ASSERT_EQ(sg_session_notify(s, "hello", 5), SG_OK);
    ASSERT_EQ(wait_for_word(s, 10), SG_OK) << "no message from the peer across the fabric";

    ASSERT_EQ(kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    reaper.pid = -1;

    const auto start = std::chrono::steady_clock::now();
    sg_status_t st = SG_OK;
    char detail[256] = "";
    while (st == SG_OK && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
        (void)sg_session_notify(s, "after", 5);  // each notify posts a message to the peer
        sg_session_error(s, &st, detail, sizeof detail);
        if (st == SG_OK) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(st, SG_ERR_PEER_LOST) << detail;
    EXPECT_NE(std::strstr(detail, "shm endpoint is gone"), nullptr) << detail;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
    sg_session_destroy(s);
    sg_context_destroy(c);
}

// libfabric 1.17 keeps each shm region's spin lock at byte 24 of its header (version 4, then the
// owner's pid at byte 4). Taking it here stands for a process killed inside the provider's critical
// section, which a test cannot time by hand. Returns false when no region of `pid` has that layout.
bool hold_region_lock_of(pid_t pid) {
    const std::string prefix = "smartgen-" + std::to_string(pid) + "-";
    std::string name;
    if (DIR *dir = opendir("/dev/shm")) {
        while (dirent *e = readdir(dir))
            if (std::string(e->d_name).rfind(prefix, 0) == 0 && std::strchr(e->d_name, '_') == nullptr) name = e->d_name;
        closedir(dir);
    }
    if (name.empty()) return false;
    const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return false;
    void *map = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) return false;
    auto *head = static_cast<uint8_t *>(map);
    int32_t owner = 0;
    std::memcpy(&owner, head + 4, sizeof owner);
    if (head[0] != 4 || owner != pid) return false;
    // Through the mapping, as the provider would: its spin lock is process-shared. Then the
    // region's signal (the word after the lock), as a poster raises it, so that the owner's next
    // progress takes the lock.
    if (pthread_spin_trylock(reinterpret_cast<pthread_spinlock_t *>(head + 24)) != 0) return false;
    __atomic_store_n(reinterpret_cast<int32_t *>(head + 28), 1, __ATOMIC_RELEASE);
    return true;  // the mapping stays: the lock must outlive this call
}

// Which lock the peer leaves held when it is killed.
enum class HeldLock : char { Ours = 'O', Its = 'I' };

// A peer process: reads the port to connect to from `from_parent`, exchanges a message, takes the
// lock when `hold`, says so on `to_parent` ('L'; 'S' when the region is not libfabric 1.17's; 'N'
// when told not to) and waits to be killed. Forked before the test's own context exists: a child
// forked after it inherits libfabric's list of this process's shm endpoints, takes the parent's for
// its own, and talks to it by another path (under ASan, no message got across in 20 s).
[[noreturn]] void run_lock_holding_peer(int from_parent, HeldLock which, bool hold, int to_parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    alarm(60);
    uint16_t port = 0;
    if (read(from_parent, &port, sizeof port) != ssize_t(sizeof port)) _exit(2);
    sg_context_t c = make_shm_context(60000);
    sg_session_options_t so;
    sg_session_options_init(&so);
    sg_session_t s = nullptr;
    if (!c || sg_session_connect(c, "127.0.0.1", port, &so, 20ull * 1000000000ull, &s, nullptr) != SG_OK) _exit(3);
    if (sg_session_notify(s, "ready", 5) != SG_OK) _exit(4);
    if (wait_for_word(s, 20) != SG_OK) _exit(5);
    const char said = !hold ? 'N' : hold_region_lock_of(which == HeldLock::Ours ? getppid() : getpid()) ? 'L' : 'S';
    if (write(to_parent, &said, 1) != 1) _exit(6);
    for (;;) pause();
}

// The wedge fails the test by its alarm instead of hanging ctest until its timeout.
void wedged(int) {
    static const char msg[] = "a shm context stayed wedged behind a dead process's spin lock\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(1);
}

// Connects a peer that holds `which` lock when it is killed, and checks that this context learns
// of the loss and then serves a new peer. Returns false when the layout is not libfabric 1.17's.
bool survive_a_peer_killed_holding(HeldLock which) {
    signal(SIGALRM, wedged);
    alarm(45);
    // Both peers first, then this side's context (run_lock_holding_peer says why).
    pid_t children[2];
    int port_pipes[2][2], said_pipes[2][2];
    for (int round = 0; round < 2; ++round) {
        EXPECT_EQ(pipe(port_pipes[round]), 0);
        EXPECT_EQ(pipe(said_pipes[round]), 0);
        children[round] = fork();
        if (children[round] == 0) {
            ::close(port_pipes[round][1]);
            ::close(said_pipes[round][0]);
            run_lock_holding_peer(port_pipes[round][0], which, round == 0, said_pipes[round][1]);
        }
        ::close(port_pipes[round][0]);
        ::close(said_pipes[round][1]);
    }
    sg_context_t c = make_shm_context(2000);
    if (!c) return true;
    sg_listener_t l = nullptr;
    uint16_t port = 0;
    EXPECT_EQ(sg_listener_create(c, "127.0.0.1", 0, &l, nullptr), SG_OK);
    EXPECT_EQ(sg_listener_port(l, &port), SG_OK);
    bool layout_known = true;
    for (int round = 0; round < 2; ++round) {
        const pid_t child = children[round];
        EXPECT_EQ(write(port_pipes[round][1], &port, sizeof port), ssize_t(sizeof port));
        ::close(port_pipes[round][1]);
        sg_session_options_t so;
        sg_session_options_init(&so);
        sg_session_t s = nullptr;
        EXPECT_EQ(sg_session_accept(l, &so, 20ull * 1000000000ull, &s, nullptr), SG_OK) << sg_last_error_message();
        EXPECT_EQ(sg_session_notify(s, "hello", 5), SG_OK);
        if (round == 1) {  // the second peer is only there to show the context still serves
            EXPECT_EQ(wait_for_word(s, 10), SG_OK) << "no message from a new peer after the first was killed";
        }
        char said = 0;
        EXPECT_EQ(read(said_pipes[round][0], &said, 1), 1);
        ::close(said_pipes[round][0]);
        if (round == 0) layout_known = said == 'L';
        if (round == 0 && said == 'L') {
            // Something for our progress to do while the lock is held, as a busy session always
            // has: with the peer's lock held, the post waits on it (the flock check before each post
            // only catches a peer that is gone before it); with ours held, the post's completion
            // wakes our progress, which waits on our lock. Then the kill lands.
            std::thread poster([s] { (void)sg_session_notify(s, "stuck", 5); });
            // With ours held, past the breaker's second on our own region, so that at the kill only
            // the peer's death is missing for it to act.
            std::this_thread::sleep_for(std::chrono::milliseconds(which == HeldLock::Ours ? 1500 : 200));
            kill(child, SIGKILL);
            poster.join();
        } else {
            kill(child, SIGKILL);
        }
        waitpid(child, nullptr, 0);
        if (round == 1) {
            sg_session_destroy(s);
            break;
        }
        const auto start = std::chrono::steady_clock::now();
        sg_status_t st = SG_OK;
        char detail[256] = "";
        while (st == SG_OK && std::chrono::steady_clock::now() - start < std::chrono::seconds(15)) {
            // No post from here: only the progress can find this loss (a keep-alive that meets the
            // dead peer, or its silence), and only once nothing holds it on the lock.
            sg_session_error(s, &st, detail, sizeof detail);
            if (st == SG_OK) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        EXPECT_EQ(st, SG_ERR_PEER_LOST) << detail;
        // peer_timeout_ms 2000, and the breaker waits a second on a lock in our own region.
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(6)) << detail;
        sg_session_destroy(s);
    }
    sg_listener_destroy(l);
    sg_context_destroy(c);
    alarm(0);
    return layout_known;
}

// The other half of the wedge above, which the flock check cannot see: a peer killed while it
// posted to us leaves the lock of *our* region held, and our own progress spun on it for good (a
// soak.short run in CI: a decode context never noticed its killed prefill, nor took the restarted
// one's session). The lock breaker releases it once the lock has been held a second while a peer
// of this process is dead.
TEST(ShmRegions, APeerKilledWhilePostingToUsDoesNotWedgeOurProgress) {
    if (!survive_a_peer_killed_holding(HeldLock::Ours)) GTEST_SKIP() << "the shm regions are not libfabric 1.17's";
}

// A post that already waits on the lock of a peer's region when the peer is killed inside its own
// critical section: the breaker releases a dead owner's lock, and the post returns.
TEST(ShmRegions, APostWaitingOnADeadPeersLockReturns) {
    if (!survive_a_peer_killed_holding(HeldLock::Its)) GTEST_SKIP() << "the shm regions are not libfabric 1.17's";
}

}  // namespace
