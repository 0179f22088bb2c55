// Internal to runtime/transport (libfabric.cpp): releases spin locks that a killed process left
// held in a libfabric 1.17 shm region, and tells whether a SmartGen shm region's owner is gone
// (the test the breaker, the reaper and each post to a shm peer share).
//
// libfabric 1.17's shm provider guards each endpoint's command queue with a pthread spin lock that
// lives in the endpoint's shared region. A poster takes the *target's* lock; the owner takes its
// own lock to drain the queue. A process SIGKILLed inside either critical section leaves the lock
// held for good, and the next thread to take it spins forever inside the provider with the
// runtime's locks held: a peer killed while it posted to us wedges our progress (the context never
// notices the loss nor takes the restarted peer's session; soak.short in CI), and a peer killed
// while it drained its own queue wedges our next post to it.
//
// The breaker watches the lock word of every region a SmartGen shm endpoint of this process owns
// or talks to, through its own small mapping of the region's header, every kSamplePeriod. It
// stores "unlocked" only where no live process can hold the lock:
//  - a peer's region: held for kPeerHeldFor and its owner is gone (nobody holds the shared flock
//    a live SmartGen endpoint keeps on its region). Only posters into a dead region remain.
//  - our own region: held for kOwnHeldFor while a peer of this process is known dead (a watched
//    peer region whose owner is gone, now or within kDeathMemory). A live holder keeps the lock
//    for microseconds; it would have to be descheduled inside it for the whole window.
// It recognises only libfabric 1.17's region header (version 4, the pid of the region's name in
// its pid field); with any other library or layout it watches nothing (newer providers have other
// locks), and the wedge stays possible there.
#pragma once

#include <cstdint>
#include <string>

namespace sg::transport::shm {

// Starts watching a region by its shm name. Returns a token for unwatch, or 0 when the region's
// header is not one this breaker understands (then nothing is watched).
uint64_t watch_region(const std::string &name, bool own);
void unwatch_region(uint64_t token);

// True when nobody holds the shared flock a live SmartGen endpoint keeps on its region (the
// region's process is gone); the caller then holds the region's flock exclusively.
bool region_owner_gone(int fd);

// Locks released since the process started (for tests and diagnostics).
uint64_t locks_released();

}  // namespace sg::transport::shm
