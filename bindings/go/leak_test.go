package smartgen

import (
	"context"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"
)

// rssKiB and fdCount read /proc/self: the process's resident memory and open descriptors.
func rssKiB(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			f := strings.Fields(line)
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	return -1
}

func fdCount(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// One cycle as a host that serves request after request would leak it if it leaked: two contexts,
// a session between them, a pool each, one transfer, everything closed.
func leakCycle(t *testing.T, key []byte, provider string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a, err := NewContext(ContextOptions{Provider: provider, AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewContext(ContextOptions{Provider: provider, AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ma, err := a.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	mb, err := b.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	sa, err := a.SessionFromMetadata(mb)
	if err != nil {
		t.Fatal(err)
	}
	defer sa.Close()
	sb, err := b.SessionFromMetadata(ma)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	pa, err := NewPool(testLayout)
	if err != nil {
		t.Fatal(err)
	}
	defer pa.Close()
	pb, err := NewPool(testLayout)
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	ka, err := a.Register(pa)
	if err != nil {
		t.Fatal(err)
	}
	defer ka.Close()
	kb, err := b.Register(pb)
	if err != nil {
		t.Fatal(err)
	}
	defer kb.Close()
	if err := sa.Export(ka); err != nil {
		t.Fatal(err)
	}
	if err := sb.Export(kb); err != nil {
		t.Fatal(err)
	}
	y, err := sb.Expect("leak", kb, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	x, err := sa.Post("leak", ka, prefillTable, 7*16, TransferOptions{Flags: AllLayersWritten})
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := x.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	y.Release()
	x.Release()
}

// Memory and descriptors stay flat over many cycles (0.4 grew 0.6-3.4 MB a cycle in Go).
// SMARTGEN_LEAK_CYCLES sets the count (default 200; the release phase runs 2,000) and
// SMARTGEN_LEAK_PROVIDER the provider (default shm: a tcp context takes ~100 ms to make).
func TestCyclesLeakNeitherMemoryNorDescriptors(t *testing.T) {
	cycles := 200
	if s := os.Getenv("SMARTGEN_LEAK_CYCLES"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("SMARTGEN_LEAK_CYCLES=%q", s)
		}
		cycles = n
	}
	provider := "shm"
	if p := os.Getenv("SMARTGEN_LEAK_PROVIDER"); p != "" {
		provider = p
	}
	key := testKey(t)
	warm := cycles / 10
	for i := 0; i < warm; i++ {
		leakCycle(t, key, provider)
	}
	// Retained memory, not the collector's pacing: collect and hand free pages back first, so the
	// garbage of the last cycles (which GOGC lets grow with the heap) is not counted as a leak.
	settle := func() {
		runtime.GC()
		debug.FreeOSMemory()
	}
	settle()
	rss0, fd0 := rssKiB(t), fdCount(t)
	start := time.Now()
	for i := 0; i < cycles; i++ {
		leakCycle(t, key, provider)
	}
	settle()
	rss1, fd1 := rssKiB(t), fdCount(t)
	perCycle := float64(rss1-rss0) / float64(cycles)
	t.Logf("%s, %d cycles in %.1f s: RSS %d -> %d KiB (%.1f KiB a cycle), fds %d -> %d", provider, cycles,
		time.Since(start).Seconds(), rss0, rss1, perCycle, fd0, fd1)
	if fd1 > fd0+4 {
		t.Errorf("descriptors grew from %d to %d over %d cycles", fd0, fd1, cycles)
	}
	if perCycle > 16 {
		t.Errorf("RSS grew %.1f KiB a cycle over %d cycles (%d -> %d KiB)", perCycle, cycles, rss0, rss1)
	}
}
