package smartgen

import (
	"context"
	"errors"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// startEtcd runs a one-member etcd on free loopback ports for the test (Debian's etcd-server, which
// scripts/setup-deps.sh installs), and returns its client endpoint.
func startEtcd(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("needs etcd (Debian's etcd-server; scripts/setup-deps.sh installs it)")
	}
	// A port that binds now, below the kernel's ephemeral range: one the kernel handed out and took
	// back could go to another process's socket before etcd binds it.
	rng := rand.New(rand.NewSource(time.Now().UnixNano() ^ int64(os.Getpid())))
	port := func() int {
		for attempt := 0; attempt < 200; attempt++ {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(20000+rng.Intn(12000)))
			if err == nil {
				defer l.Close()
				return l.Addr().(*net.TCPAddr).Port
			}
		}
		t.Fatal("no free port in 20000-31999")
		return 0
	}
	client := "http://127.0.0.1:" + strconv.Itoa(port())
	peer := "http://127.0.0.1:" + strconv.Itoa(port())
	cmd := exec.Command(bin, "--name", "m0", "--data-dir", t.TempDir(), "--listen-client-urls", client,
		"--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "m0="+peer, "--log-level", "error", "--logger", "zap")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return client
}

// Two contexts that know only the cluster's endpoint and a name: one publishes, the other looks it
// up and connects, the first accepts, and a transfer moves every byte. Unpublish and Close withdraw.
func TestDirectoryPublishConnectAcceptTransfer(t *testing.T) {
	endpoint := startEtcd(t)
	key := testKey(t)
	a, err := NewContext(ContextOptions{Provider: "tcp", AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewContext(ContextOptions{Provider: "tcp", AuthKey: key})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var da, db *Directory
	for deadline := time.Now().Add(20 * time.Second); ; { // the member elects itself first
		if da, err = a.OpenDirectory(DirectoryOptions{Endpoints: endpoint, LeaseTTL: 2 * time.Second}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	defer da.Close()
	if db, err = b.OpenDirectory(DirectoryOptions{Endpoints: endpoint}); err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		if err = da.Publish(ctx, "prefill/go-0"); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if names, err := db.List(ctx, "prefill/"); err != nil || len(names) != 1 || names[0] != "prefill/go-0" {
		t.Fatalf("list: %q, %v", names, err)
	}
	if names, err := db.List(ctx, "decode/"); err != nil || len(names) != 0 {
		t.Fatalf("list of an empty prefix: %q, %v", names, err)
	}
	if err := db.Wait(ctx, "prefill/go-0", true); err != nil {
		t.Fatalf("wait for a present name: %v", err)
	}
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	if err := db.Wait(short, "prefill/none", true); !errors.Is(err, StatusTimeout) {
		t.Fatalf("wait for an absent name: %v", err)
	}
	cancelShort()
	if blob, err := db.Lookup(ctx, "prefill/go-0"); err != nil || len(blob) == 0 {
		t.Fatalf("lookup: %d bytes, %v", len(blob), err)
	}
	if _, err := db.Lookup(ctx, "prefill/none"); !errors.Is(err, StatusNotFound) {
		t.Fatalf("lookup of an unknown name: %v", err)
	}
	type accepted struct {
		s   *Session
		err error
	}
	ch := make(chan accepted, 1)
	go func() {
		s, err := da.Accept(ctx)
		ch <- accepted{s, err}
	}()
	sb, err := db.Connect(ctx, "prefill/go-0")
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	got := <-ch
	if got.err != nil {
		t.Fatal(got.err)
	}
	sa := got.s
	defer sa.Close()
	pa, ka := newRegisteredPool(t, a)
	pb, kb := newRegisteredPool(t, b)
	fillBlocks(pa, prefillTable, 4)
	exportAndMove(ctx, t, sa, sb, ka, kb, "by-name")
	if msg := checkBlocks(pb, decodeTable, 4); msg != "" {
		t.Fatal(msg)
	}
	st, err := da.Stats()
	if err != nil || st.SessionsAccepted != 1 || st.Requests == 0 || st.LeasesGranted == 0 {
		t.Fatalf("stats: %+v, %v", st, err)
	}
	if err := da.Unpublish(ctx, "prefill/go-0"); err != nil {
		t.Fatal(err)
	}
	if err := db.Wait(ctx, "prefill/go-0", false); err != nil {
		t.Fatalf("wait for the name to go: %v", err)
	}
	if _, err := db.Lookup(ctx, "prefill/go-0"); !errors.Is(err, StatusNotFound) {
		t.Fatalf("after unpublish: %v", err)
	}
}
